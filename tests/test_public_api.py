"""The public API (`pacs_jax/__init__.py`, docs/api.md): every name imports from the top level and is documented;
notebooks/public_api.ipynb uses nothing else of the package and runs, shrunk, end to end."""

import ast
import configparser
import os
import pathlib
import re
import subprocess
import sys
import time

import nbformat
import pytest

import pacs_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "public_api.ipynb"
# The notebook's parameters cell, shrunk: two PACS steps, one validation.
SHRUNK_PARAMETERS = "STEPS = 2\nEVAL_EVERY = 2\n"


def test_the_documented_names_import_from_the_top_level():
  from pacs_jax import generate, load_config, load_pretrained, pacs_loss, train  # the line
  assert all(map(callable, (generate, load_config, load_pretrained, pacs_loss, train)))
  parser = configparser.ConfigParser()
  parser.read(ROOT / "setup.cfg")
  assert pacs_jax.__version__ == parser.get("metadata", "version")
  api_doc = (ROOT / "docs" / "api.md").read_text()
  for name in pacs_jax.__all__:
    if name == "__version__":
      continue
    value = getattr(pacs_jax, name)
    assert (value.__doc__ or "").strip(), f"pacs_jax.{name} has no docstring"
    assert f"`{name}" in api_doc, f"docs/api.md does not describe pacs_jax.{name}"
  assert callable(train) and train.__doc__.startswith("Trains until")
  with pytest.raises(AttributeError):
    pacs_jax.no_such_name  # noqa: B018


def test_load_config_takes_a_shipped_name_or_a_path():
  from pacs_jax import load_config
  by_name = load_config("tiny_cpu", {"steps": 3})
  by_path = load_config(str(ROOT / "configs" / "tiny_cpu.py"), {"steps": 3})
  assert by_name.to_dict() == by_path.to_dict() and by_name.steps == 3
  with pytest.raises(FileNotFoundError, match="no_such_config"):
    load_config("no_such_config")


def code_cells(nb) -> list[nbformat.NotebookNode]:
  return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", ["public_api.ipynb", "quickstart.ipynb", "pacs_gradient.ipynb"])
def test_the_notebooks_import_only_the_top_level_api(name):
  """Every notebook uses the package through `pacs_jax`'s public names only (issue 44: the quickstart imported the
  trainer's loop module, which docs/api.md calls internal)."""
  nb = nbformat.read(NOTEBOOK.parent / name, as_version=4)
  for cell in code_cells(nb):
    source = "\n".join(line for line in cell.source.splitlines() if not line.startswith("%"))
    inside = re.search(r"\bpacs_jax\.(?!__version__\b|__file__\b)\w", source)
    assert not inside, f"a module inside pacs_jax: {cell.source}"
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pacs_jax":
        assert node.module == "pacs_jax", ast.unparse(node)
        assert {a.name for a in node.names} <= set(pacs_jax.__all__), ast.unparse(node)
      if isinstance(node, ast.Import):
        assert all(a.name == "pacs_jax" or not a.name.startswith("pacs_jax") for a in node.names), ast.unparse(node)


def test_the_notebook_runs_shrunk(tmp_path):
  """The notebook's code cells as one script, its parameters cell shrunk, on one CPU device (as a user's kernel)."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  cells = code_cells(nb)
  assert "parameters" in cells[0].metadata.get("tags", [])
  sources = [SHRUNK_PARAMETERS] + [c.source for c in cells[1:]]
  script = "\n\n".join("\n".join(line for line in s.splitlines() if not line.startswith("%")) for s in sources)
  (tmp_path / "notebook.py").write_text(script)
  env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                              if not f.startswith("--xla_force_host_platform_device_count")))
  import jax
  if jax.config.jax_compilation_cache_dir:  # the tests' persistent compile cache
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(jax.config.jax_persistent_cache_min_compile_time_secs)
  start = time.perf_counter()
  done = subprocess.run([sys.executable, str(tmp_path / "notebook.py")], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=300)
  print(f"public_api.ipynb (shrunk) ran in {time.perf_counter() - start:.1f}s")
  assert done.returncode == 0, done.stderr[-4000:]
  assert "validation accuracy by step: [(0," in done.stdout
  assert "the reloaded model samples the same responses" in done.stdout and "loss 0.6931" in done.stdout, done.stdout


def test_train_is_the_function_whatever_was_imported_before():
  """`from pacs_jax import train` is the trainer function, also once the trainer's modules are imported and after the
  command line's module ran as `python -m pacs_jax.train` runs it (runpy binds no module to `pacs_jax.train`); no
  module of the package swaps its class."""
  probe = ("import runpy, sys, types\n"
           "import pacs_jax.trainer.loop, pacs_jax.trainer.stages\n"
           "sys.argv = ['pacs_jax.train', '--helpshort']\n"
           "try:\n"
           "  runpy.run_module('pacs_jax.train', run_name='__main__', alter_sys=True)\n"
           "except SystemExit:\n"
           "  pass\n"
           "import pacs_jax\n"
           "from pacs_jax import train\n"
           "assert train is pacs_jax.trainer.loop.train, train\n"
           "assert 'pacs_jax.train' not in sys.modules\n"
           "odd = [n for n, m in sys.modules.items() if n.startswith('pacs_jax') and type(m) is not types.ModuleType]\n"
           "assert not odd, odd\n")
  done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
