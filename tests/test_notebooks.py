"""Executes notebooks/*.ipynb with nbclient in a kernel running this interpreter; any cell error fails the test."""

import json
import os
import pathlib
import sys
import time

import ipykernel  # noqa: F401 -- the kernel the notebooks run in
import jax
import nbclient
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
KERNEL_NAME = "pacs-jax-test"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  """A private kernelspec for sys.executable (the installed `python3` spec runs whatever `python` is on PATH)
  and a kernel environment on one CPU device: the kernel inherits os.environ, and conftest's 8 simulated
  devices only slow a single-process demo down."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "pacs-jax tests",
      "language": "python",
  }))
  monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(tmp_path / "jupyter"),
                                                                  os.environ.get("JUPYTER_PATH")])))
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
  if jax.config.jax_compilation_cache_dir:  # share the tests' persistent compile cache with the kernel
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)


def execute(name: str) -> tuple[nbformat.NotebookNode, float]:
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=900, kernel_name=KERNEL_NAME,
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError (with the traceback) on the first failing cell
  return nb, time.perf_counter() - start


def outputs_text(nb) -> str:
  return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def test_pacs_gradient_notebook(kernel_env):
  nb, seconds = execute("pacs_gradient.ipynb")
  print(f"pacs_gradient.ipynb executed in {seconds:.1f}s")
  text = outputs_text(nb)
  assert "max |autodiff − policy gradient|" in text
  assert "max |autodiff − REINFORCE surrogate|" in text


@pytest.mark.slow
def test_quickstart_notebook(kernel_env):
  nb, seconds = execute("quickstart.ipynb")
  print(f"quickstart.ipynb executed in {seconds:.1f}s")
  assert "steps logged" in outputs_text(nb)
  assert any(out.get("output_type") == "display_data" and "image/png" in out.get("data", {})
             for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


@pytest.mark.parametrize("name", ["pacs_gradient.ipynb", "quickstart.ipynb", "public_api.ipynb"])
def test_notebook_is_stored_without_outputs(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear outputs before committing"
