"""Orbax's and tensorstore's failures in one line: a save's or restore's root cause (a full disk by its name), and a
restore target whose tree differs from the checkpoint's, by the names that differ."""

from __future__ import annotations

import errno
import os
import re


def describe(e: BaseException) -> str:
  """The root cause in one line (Orbax wraps tensorstore's precise error in a long generic one)."""
  seen = []
  while e is not None and e not in seen:
    seen.append(e)
    e = e.__cause__
  root = seen[-1]
  # A full or read-only disk by its name, not tensorstore's long line (cut mid-path below) around its errno.
  codes = [getattr(link, "errno", None) for link in seen]
  codes += [int("".join(m)) for m in _ERRNO_IN_TEXT.findall("\n".join(map(str, seen)))]
  disk = next((c for c in codes if c in _DISK_ERRNOS), None)
  if disk is not None:
    return os.strerror(disk)
  lines = [line for line in str(root).strip().splitlines() if line.strip()]
  return f"{type(root).__name__}: {lines[0][:300]}" if lines else type(root).__name__


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
_ERRNO_IN_TEXT = re.compile(r"os_error_code='(\d+)'|\[Errno (\d+)\]|\(os error (\d+)\)")  # tensorstore, Python, Rust


_STRUCTURE_MISMATCH = "User-provided restore item and on-disk value metadata tree structures do not match"


def structure_difference(message: str) -> str | None:
  """Orbax's refusal of a target whose tree differs from the saved one, as "not in the checkpoint: x; not in this
  run's: y; of another form: z" (at most 3 names each); None for any other error."""
  lines = message.splitlines()
  if not lines or not lines[0].startswith(_STRUCTURE_MISMATCH):
    return None
  kinds: dict[str, list[str]] = {"missing": [], "extra": [], "other": []}
  key = None
  for line in lines[1:]:
    if line and not line[0].isspace() and line.endswith(":"):
      key = line[:-1]
      kinds["other"].append(key)
    elif key and line.strip() in ("- Target: MISSING", "- Source: MISSING"):
      kinds["other"].remove(key)
      kinds["missing" if "Target" in line else "extra"].append(key)
  names = lambda keys: ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
  parts = [f"{label}: {names(kinds[kind])}" for kind, label in (
      ("missing", "not in the checkpoint"), ("extra", "not in this run's"), ("other", "of another form")) if kinds[kind]]
  return "; ".join(parts) or "the trees differ"
