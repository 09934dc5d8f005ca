"""The commands' output carries no library's import-time notes (issue 35): transformers' "PyTorch was not found"
(where torch is absent), gcsfs's "experimental features enabled" and matplotlib's "generated new fontManager" (at
INFO, which the commands' absl logging shows); nor jax's CUDA plugin's driver lines where no CUDA runtime is, and the
project's own code raises no warning (issue 44)."""

import subprocess
import sys
import warnings

import pytest
from flax import nnx

from pacs_jax.models import families, hf

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


# A command line's start as train, evaluate and export begin, then the first backend (where jax loads its plugins).
COMMAND_START = """
import sys
from pacs_jax import errors
errors.stop_on_ctrl_c("probe")
import jax
jax.devices()
print("a line of the program's own", file=sys.stderr)
"""


def test_a_command_line_prints_no_cuda_driver_lines():
  """jax's CUDA plugin (the test extras install it) where no CUDA runtime is printed `cudart_stub.cc:31] Could not
  find cuda drivers on your machine, GPU will not be used.`, each after absl's `WARNING: All log messages before
  absl::InitializeLog() is called are written to STDERR`: 8 lines at the start of every `train` (issue 44). Without
  the plugin this passes as it is."""
  result = subprocess.run([sys.executable, "-c", COMMAND_START], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "cudart_stub.cc" not in result.stderr and "absl::InitializeLog()" not in result.stderr, result.stderr
  assert "a line of the program's own" in result.stderr


def test_the_weights_check_raises_no_warning():
  """models/hf.py's non-finite check read each tensor's flag as `.value`: 84 "'.value' access is now deprecated"
  warnings in a test run."""
  config = families.preset("tiny", vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
  params = nnx.state(families.causal_lm(config, rngs=nnx.Rngs(0)), nnx.Param)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    hf.refuse_non_finite(params, "tiny")


def test_a_warning_the_project_raises_fails_the_test():
  """setup.cfg's filterwarnings: a warning told at a pacs_jax line is an error in the tests; one told elsewhere is
  only recorded (no test expects a warning from pacs_jax)."""
  code = compile("import warnings\nwarnings.warn('deprecated here', DeprecationWarning)", "probe.py", "exec")
  with pytest.raises(DeprecationWarning, match="deprecated here"):
    exec(code, {"__name__": "pacs_jax.models.probe"})  # pylint: disable=exec-used
  with pytest.warns(DeprecationWarning, match="deprecated here"):
    exec(code, {"__name__": "elsewhere"})  # pylint: disable=exec-used
