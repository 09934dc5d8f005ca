"""The live processes of this machine, read from /proc (the sandbox and kill tests: what a run left behind)."""

import os


def live_processes() -> list[tuple[int, int, int, int, str]]:
  """(pid, parent, process group, session, command line) of each live (not zombie) process."""
  out = []
  for name in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      with open(f"/proc/{name}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended meanwhile
      continue
    if fields[0] != "Z":
      out.append((int(name), int(fields[1]), int(fields[2]), int(fields[3]), cmdline))
  return out
