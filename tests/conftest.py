"""Test setup: 8 simulated CPU devices (before jax is imported) and shared tiny-model fixtures."""

import functools
import os
import re
import sys

# Byte-code caches on, for this process and every process it starts: on a machine with PYTHONDONTWRITEBYTECODE=1
# (this host's image sets it; the install skips byte-compiling, .ci/run) each of the suite's Python processes would
# compile jax, torch, transformers and sympy from source (importing the trainer: 3.0 s of CPU from source, 1.1 s
# from the caches). Each module is compiled once, by the first process that imports it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# CPU unless a GPU / TPU run is asked for: with libtpu installed (a test dependency, for compiling TPU
# programs ahead of time) jax would otherwise look for a TPU first. Subprocesses inherit it.
if not os.environ.get("JAX_PLATFORMS"):
  os.environ["JAX_PLATFORMS"] = "cpu"
_CPU_TESTS = "cuda" not in os.environ["JAX_PLATFORMS"] and "tpu" not in os.environ["JAX_PLATFORMS"]
if _CPU_TESTS:
  # LLVM at -O0, not XLA's default -O2: the suite compiles hundreds of tiny CPU programs and runs each a few
  # times, and most of its CPU time is XLA compiling them. A 12-step tiny_cpu run takes 14.9 s of CPU at -O0,
  # 17.3 s at -O1, 19.1 s at -O2, its steps as fast; results agree to the last bits of a mean or two. Test files
  # marked `xla_o1` compile at -O1 (`_xla_level` below): those that compare two programs' bits (one batch shape
  # against another, a chunked head against the whole one), whose rounding -O0 does not keep alike. Test
  # subprocesses inherit these flags (tests/child_env.py); commands a test runs as a user would (the demo, the
  # README's first hour) keep XLA's defaults.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                             " --xla_force_host_platform_device_count=8").strip()
# A Cloud Storage request is tried 3 times (about 3 s of waiting), not 5 (15 s: pacs_jax/paths.py): the outage tests
# wait out a refusing store's retries, subprocesses included, and a blip of 1.5 s still passes.
os.environ.setdefault("PACS_JAX_STORAGE_ATTEMPTS", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "tpu" not in os.environ["JAX_PLATFORMS"]:
  # Tests compile for abstract TPU topologies (no TPU attached) in several processes at once (xdist workers,
  # CLI subprocesses): libtpu's one-process-per-host lockfile would make all but the first fail.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Programs compiled ahead of time (TPU / GPU targets: the persistent cache cannot hold them) are kept per process and
# reused when a test compiles the same program again (compile/aot_measure.py's memo; subprocesses inherit it).
os.environ.setdefault("PACS_JAX_AOT_MEMO", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Persistent compile cache: test processes (and reruns) reuse each other's compiled programs. Every Python
# subprocess a test starts (the command lines, killed-and-resumed runs, multi-process runs) inherits it through
# jax's own environment variables: a tiny_cpu run's 3 steps take ~10 s with its programs cached against ~30 s cold,
# and most subprocess tests start the same few configs again and again.
_CACHE = os.path.abspath(os.environ.get("PACS_JAX_TEST_CACHE",
                                        os.path.join(os.path.dirname(__file__), "..", ".jax_cache")))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

if _CPU_TESTS:
  # A compile under jax's `jax_optimization_level` "O1" (a jit-key setting: programs compiled at another level are
  # not reused) runs LLVM at -O1. jax passes that setting on without a CPU meaning; its compile options are built in
  # one private function, wrapped here.
  from jax._src import compiler as _jax_compiler  # noqa: E402
  from jax._src import config as _jax_config  # noqa: E402

  _get_compile_options = _jax_compiler.get_compile_options

  def _get_compile_options_at_the_tests_level(*args, **kwargs):
    options = _get_compile_options(*args, **kwargs)
    if _jax_config.optimization_level.value == "O1":
      options.executable_build_options.debug_options.xla_backend_optimization_level = 1
    return options

  _jax_compiler.get_compile_options = _get_compile_options_at_the_tests_level


@pytest.fixture(scope="module", autouse=True)
def _xla_level(request):
  """A file marked `xla_o1` compiles at LLVM -O1, its module fixtures included (see XLA_FLAGS above)."""
  if not _CPU_TESTS or request.node.get_closest_marker("xla_o1") is None:
    yield
    return
  saved = _jax_config.optimization_level.value
  jax.config.update("jax_optimization_level", "O1")
  try:
    yield
  finally:
    jax.config.update("jax_optimization_level", saved)


def pytest_collection_modifyitems(config, items):
  """`gpu`-marked tests run only where jax's default backend is a GPU. Under xdist, the longest tests first."""
  if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the order work is handed out
    items.sort(key=_rank)  # stable: within a rank, collection order
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU (jax's default backend is not gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


# Scheduling under xdist (CI runs `pytest -n 2` on 2 cores). xdist's default (`--dist load`) deals tests out in
# collection order, in chunks that cut through files: a file's module-scoped fixture (a compiled TPU program, a
# trained run, a study) was then built by both workers, and the slowest files, last in alphabetical order
# (tests/train/), left one worker running alone at the end. Here (hooks below):
# - a file that defines a module- or class-scoped fixture is one unit of work, run by one worker (its fixtures are
#   built once); every other test is a unit of its own;
# - units go out longest first, each to the next idle worker: SLOWEST's files and tests in its order, then the
#   tests marked `slow`, then the files with module fixtures, then the tests of files that train (tests/train/) or
#   start processes, then the rest (unit tests of a second or less) in collection order: the run ends on short ones.
# SLOWEST: test files or test ids, longest first (seconds: a full run with --durations=0 on the 2-core machine, 2
# workers, beside other work, issue 42's session; CI's idle run takes about 0.7x).
SLOWEST = (
    "tests/train/test_tool_demo_learns.py",  # 230 (at -O1): the base's warm-up, up to 60 steps with the tool
    "tests/train/test_fsdp_matmuls_tpu.py",  # 170: three TPU compiles of a one-layer 3B (module fixture)
    "tests/train/test_split_devices.py::test_a_split_run_on_two_processes_trains_as_one_process",  # 150
    "tests/train/test_demo_learns.py",  # 60-140 each
    "tests/train/test_first_hour.py",  # 120
    "tests/train/test_lora_resume.py",  # 106
    "tests/test_multihost.py::test_dynamic_sampling_on_two_processes_matches_one",  # 102
    "tests/train/test_gcs_workdir.py",  # 98
    "tests/train/test_resume.py",  # 92 + 62
    "tests/test_multihost.py",  # 90 each
    "tests/train/test_overlap_resume.py",  # 65-90 each
    "tests/train/test_failures.py",  # 40-80 each
    "tests/test_study.py",  # 82: one shrunk study (module fixture)
    "tests/train/test_compile_only.py",  # 72 + the update at length profiles
    "tests/test_configs_e2e.py",  # 10-35 each alone (qwen7b_tools_v5p the longest; 279 before 2 micro-batches a mini)
)
_MODULE_FIXTURE = re.compile(r"""scope\s*=\s*["'](module|class|package)["']""")


def _rank(item) -> int:
  nodeid = item.nodeid
  for i, prefix in enumerate(SLOWEST):
    if nodeid == prefix or nodeid.startswith(prefix + "::"):
      return i
  if item.get_closest_marker("slow"):
    return len(SLOWEST)
  path = nodeid.split("::", 1)[0]
  if _one_unit(path):
    return len(SLOWEST) + 1
  return len(SLOWEST) + (2 if path.startswith("tests/train/") or "sys.executable" in _source(path) else 3)


@functools.cache
def _source(path: str) -> str:
  try:
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)) as f:
      return f.read()
  except OSError:
    return ""


def _one_unit(path: str) -> bool:
  """Whether the test file defines a module- or class-scoped fixture (its tests then share one worker)."""
  return bool(_MODULE_FIXTURE.search(_source(path)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "load":  # another --dist, asked for by name, is xdist's own
    return None
  from xdist.scheduler import LoadScopeScheduling

  class FilesWithModuleFixturesLongestFirst(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      path = nodeid.split("::", 1)[0]
      return path if _one_unit(path) else nodeid

  config.option.loadscopereorder = False  # units in the workers' collection order (longest first), not by size
  return FilesWithModuleFixturesLongestFirst(config, log)


# A few real rows of each released data set (tests/fixtures/data/SOURCES.md): the tests read nothing outside the repo.
RELEASED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "data")


@pytest.fixture(scope="session")
def released_data():
  return RELEASED_DATA


@pytest.fixture(scope="session")
def local_gcs():
  """A Cloud Storage emulator on 127.0.0.1 (see tests/gcs_emulator.py), with this process's environment
  pointed at it; tests share its bucket, so each uses its own prefix. Subprocesses get `local_gcs.env`."""
  import fsspec
  from etils.epath import backend
  from gcs_emulator import LocalGCS

  gcs = LocalGCS()
  saved = {k: os.environ.get(k) for k in gcs.env}
  os.environ.update(gcs.env)
  fsspec.get_filesystem_class("gcs").clear_instance_cache()  # a cached client would keep another endpoint
  backend.fsspec_backend._get_filesystem.cache_clear()
  yield gcs
  gcs.close()
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  fsspec.get_filesystem_class("gcs").clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()
