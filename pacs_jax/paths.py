"""One path layer for workdirs and data files: local paths and `gs://` URIs (etils.epath over fsspec/gcsfs).

An object store has no append and no rename, but writes a whole object atomically: `write_atomic` and
`append` are atomic on both kinds (a local temporary file renamed into place; one object upload). A request to
Cloud Storage is retried for about 15 s (`STORAGE_RETRIES`), then the store counts as unreachable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator

import fsspec
from etils import epath

# Several processes share a workdir (trainer, export, Orbax's tensorstore writes): a cached listing
# would hide their files from this one, so gcsfs lists afresh each time.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)

PathLike = str | os.PathLike


class StorageError(OSError):
  """A write to a workdir failed (a full disk, an unreachable bucket); the message names the path and cause."""


class StorageUnreachable(StorageError):
  """The object store holding a workdir stopped answering (`unreachable` says why)."""


@dataclasses.dataclass(frozen=True)
class Retries:
  """How a request to an object store is retried: `attempts` in all, waiting `first_delay_s`, then twice as
  long each time up to `max_delay_s` (gcsfs's own schedule doubles from 1 s as well)."""
  attempts: int
  first_delay_s: float
  max_delay_s: float


# An outage must end a run in tens of seconds, not the minutes of the clients' defaults (gcsfs: 6 attempts,
# ~35 s per request, and one operation makes several; tensorstore: 32 attempts up to 32 s apart), so that a
# restart resumes soon from the last checkpoint; yet a blip (a dropped connection, a few 503s) must pass
# unnoticed. 5 attempts wait about 1 + 2 + 4 + 8 = 15 s between them before a request fails.
# PACS_JAX_STORAGE_ATTEMPTS=N sets another count (a store known to be slow to come back: more; the tests: 3, about 3 s).
ATTEMPTS_ENV = "PACS_JAX_STORAGE_ATTEMPTS"


def storage_retries(environ: dict[str, str] | None = None) -> Retries:
  """The retry schedule: 5 attempts, or `PACS_JAX_STORAGE_ATTEMPTS` of them (a whole number from 1 to 20)."""
  value = (os.environ if environ is None else environ).get(ATTEMPTS_ENV, "5")
  if not value.strip().isdigit() or not 1 <= int(value) <= 20:
    raise ValueError(f"{ATTEMPTS_ENV}={value!r}: attempts per Cloud Storage request, a whole number from 1 to 20")
  return Retries(attempts=int(value), first_delay_s=1.0, max_delay_s=8.0)


STORAGE_RETRIES = storage_retries()
PROBE_TIMEOUT_S = 10.0  # one request that says whether the store answers at all (`unreachable`)


# gcsfs (with google-auth and cryptography: seconds of import) loads on a run's first gs:// path, not at import:
# fsspec imports a class registered by name when the protocol is first used.
for _protocol in ("gs", "gcs"):  # (etils.epath and Orbax open gs:// paths through fsspec's registry)
  fsspec.register_implementation(_protocol, "pacs_jax.gcs_retries.GCSFileSystem", clobber=True)


def is_remote(path: PathLike) -> bool:
  """A URI (`gs://bucket/dir`), as opposed to a local path."""
  return "://" in os.fspath(path)


def unreachable(p: PathLike) -> str | None:
  """Why the object store holding `p` does not answer ("Connection refused", "timed out", "HTTP 503 Service
  Unavailable"), from one request without retries; None when it answers (whatever it answers: a refusal to an
  anonymous client is an answer) and for local paths."""
  text = normalize(p)
  if not text.startswith(("gs://", "gcs://")):
    return None
  bucket = text.split("://", 1)[1].split("/", 1)[0]
  try:
    urllib.request.urlopen(f"{fsspec.filesystem('gs').base}b/{bucket}", timeout=PROBE_TIMEOUT_S).close()
  except urllib.error.HTTPError as e:
    return f"HTTP {e.code} {e.reason}" if e.code >= 500 else None
  except (urllib.error.URLError, OSError) as e:
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, (socket.timeout, TimeoutError)):
      return "timed out"
    return getattr(reason, "strerror", None) or str(reason)
  return None


def normalize(path: PathLike) -> str:
  """An absolute local path, or the URI unchanged (never a local folder named `gs:`)."""
  text = os.fspath(path)
  return text.rstrip("/") if is_remote(text) else os.path.abspath(os.path.expanduser(text))


def canonical(p: PathLike) -> str:
  """`normalize` with local symlinks resolved: one name per location (to compare locations)."""
  return normalize(p) if is_remote(p) else os.path.realpath(normalize(p))


def path(p: PathLike) -> epath.Path:
  return epath.Path(normalize(p))


def join(base: PathLike, *parts: str) -> str:
  return "/".join([normalize(base), *parts]) if is_remote(base) else os.path.join(normalize(base), *parts)


def parent(p: PathLike) -> str:
  text = normalize(p)
  return text.rsplit("/", 1)[0] if is_remote(text) else os.path.dirname(text)


def exists(p: PathLike) -> bool:
  return path(p).exists()


def isfile(p: PathLike) -> bool:
  return path(p).is_file()


def isdir(p: PathLike) -> bool:
  return path(p).is_dir()


def listdir(p: PathLike) -> list[str]:
  """Names in a directory; [] when it does not exist."""
  d = path(p)
  return sorted(child.name for child in d.iterdir()) if d.is_dir() else []


def makedirs(p: PathLike) -> None:
  """Creates a local directory; a no-op for object stores, which have none."""
  if not is_remote(p):
    os.makedirs(normalize(p), exist_ok=True)


def open(p: PathLike, mode: str = "r"):  # noqa: A001 (mirrors builtins.open)
  """Binary modes as they are; text modes decode UTF-8 (whatever the locale)."""
  if "a" in mode:
    raise ValueError("use paths.append: object stores have no append mode")
  binary = path(p).open(mode.replace("t", "").replace("b", "") + "b")
  return binary if "b" in mode else io.TextIOWrapper(binary, encoding="utf-8")


def read_text(p: PathLike) -> str:
  return path(p).read_bytes().decode("utf-8")


def read_bytes(p: PathLike) -> bytes:
  return path(p).read_bytes()


def current_umask() -> int:
  """The process's file-creation mask (read by setting it and setting it back, as there is no getter)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def ordinary_permissions(local: str) -> None:
  """Gives a local file, or a folder and everything in it, the modes a plain `open` or `mkdir` would have (0o666 /
  0o777 less the umask): safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 folders, which a
  serving process of another user could not read."""
  mask = current_umask()
  if not os.path.isdir(local):
    os.chmod(local, 0o666 & ~mask)
    return
  os.chmod(local, 0o777 & ~mask)
  for root, dirs, files in os.walk(local):
    for name in dirs:
      os.chmod(os.path.join(root, name), 0o777 & ~mask)
    for name in files:
      os.chmod(os.path.join(root, name), 0o666 & ~mask)


def write_atomic(p: PathLike, data: str | bytes) -> None:
  """Replaces the file's content in one step: readers see the old file or the new one, never a part."""
  data = data.encode("utf-8") if isinstance(data, str) else data
  if is_remote(p):
    path(p).write_bytes(data)  # an object upload only becomes visible once complete
    return
  target = normalize(p)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".tmp", dir=os.path.dirname(target))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, target)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def append(p: PathLike, data: str | bytes) -> None:
  """Appends `data` whole: one write on an O_APPEND file locally (a kill cuts at most this write); on an
  object store the object is rewritten with `data` added (atomic, cost grows with the file)."""
  data = data.encode("utf-8") if isinstance(data, str) else data
  if is_remote(p):
    old = read_bytes(p) if exists(p) else b""
    write_atomic(p, old + data)
    return
  target = normalize(p)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    written = os.write(fd, data)
    if written != len(data):  # a regular file takes it whole unless the disk is full
      raise OSError(f"{target}: wrote {written} of {len(data)} bytes")
    os.fsync(fd)
  finally:
    os.close(fd)


def remove(p: PathLike) -> None:
  with contextlib.suppress(FileNotFoundError):
    path(p).unlink()


def remove_empty_dirs(p: PathLike) -> None:
  """Removes a local directory tree that holds no file (folders only); anything with a file in it stays."""
  if is_remote(p) or not os.path.isdir(normalize(p)):
    return
  for root, _, _ in sorted(os.walk(normalize(p)), key=lambda entry: -len(entry[0])):
    with contextlib.suppress(OSError):  # not empty: a file is there
      os.rmdir(root)


def rename(src: PathLike, dst: PathLike) -> None:
  """Moves a file or directory (an object store copies then deletes: not atomic there)."""
  if is_remote(src):
    fs, _ = fsspec.core.url_to_fs(normalize(src))
    fs.mv(normalize(src), normalize(dst), recursive=True)  # (epath's rename wants dst's folder to exist)
  else:
    os.makedirs(os.path.dirname(normalize(dst)), exist_ok=True)
    os.replace(normalize(src), normalize(dst))


def copy_tree(src: PathLike, dst: PathLike, last: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> None:
  """Copies a directory tree between any two locations (local or remote), file by file; top-level names in
  `last` are copied last (a marker file whose presence says the rest is there); names ending with a suffix
  in `exclude` are left out."""
  makedirs(dst)
  children = sorted(path(src).iterdir(), key=lambda child: (child.name in last, child.name))
  for child in children:
    target = join(dst, child.name)
    if child.is_dir():
      copy_tree(os.fspath(child), target, exclude=exclude)
    elif not child.name.endswith(exclude):
      path(target).write_bytes(child.read_bytes())


@contextlib.contextmanager
def local_dir(p: PathLike, exclude: tuple[str, ...] = ()) -> Iterator[str]:
  """A local directory with the contents of `p`: `p` itself, or a temporary download of a remote one
  (without the files whose names end with a suffix in `exclude`, e.g. weights when reading a tokenizer)."""
  if not is_remote(p):
    yield normalize(p)
    return
  with tempfile.TemporaryDirectory(prefix="pacs_jax_download_") as tmp:
    copy_tree(p, tmp, exclude=exclude)
    yield tmp


@contextlib.contextmanager
def staged_dir(p: PathLike, last: tuple[str, ...] = ()) -> Iterator[str]:
  """A local directory to write into that ends up at `p`: `p` itself, or a temporary one uploaded on
  success (top-level names in `last` uploaded last)."""
  if not is_remote(p):
    os.makedirs(normalize(p), exist_ok=True)
    yield normalize(p)
    return
  tmp = tempfile.mkdtemp(prefix="pacs_jax_upload_")
  try:
    yield tmp
    copy_tree(tmp, p, last=last)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def looks_local(spec: str) -> bool:
  """Whether a model/tokenizer spec is meant as a local path rather than a hub id (`owner/name`):
  it exists, starts like a path (`.`, `/`, `~`), has more than two parts, or its first part is a local folder."""
  if os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
    return True
  return os.path.isdir(spec.split("/", 1)[0])
