"""The commands' output carries no library's import-time notes (issue 35): transformers' "PyTorch was not found"
(where torch is absent), gcsfs's "experimental features enabled" and matplotlib's "generated new fontManager" (at
INFO, which the commands' absl logging shows)."""

import subprocess
import sys

SCRIPT = """
import importlib.util, logging
real = importlib.util.find_spec  # torch hidden, as on a user's machine without it
importlib.util.find_spec = lambda name, *a, **k: None if name == "torch" else real(name, *a, **k)
logging.basicConfig(level=logging.INFO)  # as absl shows INFO
import pacs_jax
import transformers, gcsfs, matplotlib.font_manager
assert not transformers.is_torch_available()
logging.getLogger("gcsfs").warning("a warning still shows")
"""


def test_library_notes_are_silenced_at_their_cause(tmp_path):
  env = {"MPLCONFIGDIR": str(tmp_path / "mpl"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # a fresh font cache
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout + result.stderr
  for note in ("PyTorch was not found", "experimental features enabled", "generated new fontManager"):
    assert note not in out, out
  assert "a warning still shows" in out
