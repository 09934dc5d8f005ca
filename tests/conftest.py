"""Test setup: 8 simulated CPU devices (before jax is imported) and shared tiny-model fixtures."""

import os

# CPU unless a GPU / TPU run is asked for: with libtpu installed (a test dependency, for compiling TPU
# programs ahead of time) jax would otherwise look for a TPU first. Subprocesses inherit it.
if not os.environ.get("JAX_PLATFORMS"):
  os.environ["JAX_PLATFORMS"] = "cpu"
if "cuda" not in os.environ["JAX_PLATFORMS"] and "tpu" not in os.environ["JAX_PLATFORMS"]:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "tpu" not in os.environ["JAX_PLATFORMS"]:
  # Tests compile for abstract TPU topologies (no TPU attached) in several processes at once (xdist workers,
  # CLI subprocesses): libtpu's one-process-per-host lockfile would make all but the first fail.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Persistent compile cache: test processes (and reruns) reuse each other's compiled programs.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("PACS_JAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

def pytest_collection_modifyitems(config, items):
  """`gpu`-marked tests run only where jax's default backend is a GPU."""
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU (jax's default backend is not gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


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
