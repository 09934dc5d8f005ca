"""Imports point one way: no module under pacs_jax/ imports from a layer above its own (issue 13)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pacs_jax"

# The layer of each top-level module or package of pacs_jax (the longest matching prefix wins). A module may
# import its own package and any lower layer; never a higher layer, nor another package of its own layer.
LAYERS = {
    "pacs_jax": 0,  # the package's __init__
    "pacs_jax.paths": 0,  # local / gs:// files
    "pacs_jax.sharding": 1,  # meshes and partition rules
    "pacs_jax.gpu_targets": 1,  # GPU target descriptions and their abstract devices
    "pacs_jax.rewards": 1,  # verifiers: import neither models nor train
    "pacs_jax.data": 2,  # records, prompts, the Grain pipeline (the synthetic tasks' verifier is in rewards)
    "pacs_jax.models": 3,
    "pacs_jax.rollout": 4,
    "pacs_jax.algos": 4,
    "pacs_jax.config": 5,  # the run config: its enums come from algos, run -> model config uses models
    "pacs_jax.storage": 6,  # workdir layout, checkpoints, lock, export: shared by train and eval
    "pacs_jax.train": 7,
    "pacs_jax.eval": 7,
    "pacs_jax.errors": 7,  # expected failures -> one line and an exit status, for the command lines
    "pacs_jax.study": 8,  # the laptop study: runs the trainer and the pass@k estimator side by side
    # The command lines, at the top.
    "pacs_jax.train.__main__": 8,
    "pacs_jax.evaluate": 8,
    "pacs_jax.export": 8,
    "pacs_jax.compare": 8,
    "pacs_jax.study.__main__": 9,  # the study's command line, above the study
}

# Packages of one layer that may import each other: (importer, imported).
PEERS = {
    ("pacs_jax.rollout", "pacs_jax.algos"),  # the sampler may share the trainer's token log-prob helper
}

# Known backwards imports, each with the reason it is still there: {(importer module, imported module): why}.
ALLOWED = {}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_key(module: str) -> str | None:
  """The LAYERS entry `module` belongs to (longest prefix), or None."""
  candidates = [k for k in LAYERS if module == k or module.startswith(k + ".")]
  return max(candidates, key=len) if candidates else None


def imported_modules(tree: ast.AST, module: str) -> set[str]:
  """pacs_jax modules (or names in them) imported anywhere in the module, function-level imports included."""
  package = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.split(".")[0] == "pacs_jax"}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolved against the importing module's package
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      if base.split(".")[0] == "pacs_jax":
        out |= {f"{base}.{a.name}" for a in node.names}  # a submodule or a name: the prefix match decides
  return out


def violations(graph: dict[str, set[str]]) -> list[str]:
  out = []
  for importer, targets in sorted(graph.items()):
    src = layer_key(importer)
    for target in sorted(targets):
      dst = layer_key(target)
      if dst is None or src == dst or dst == "pacs_jax" and target != "pacs_jax":
        continue
      if (importer, target) in ALLOWED or (src, dst) in PEERS:
        continue
      if dst.startswith(src + "."):  # a package's own command line (pacs_jax.train -> pacs_jax.train.__main__)
        out.append(f"{importer} imports {target}: a command line, layer {LAYERS[dst]} above {LAYERS[src]}")
      elif LAYERS[dst] >= LAYERS[src]:  # a higher layer, or another package of the same layer
        out.append(f"{importer} (layer {LAYERS[src]}, {src}) imports {target} (layer {LAYERS[dst]}, {dst})")
  return out


def import_graph() -> dict[str, set[str]]:
  return {module_name(p): imported_modules(ast.parse(p.read_text(), str(p)), module_name(p))
          for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
  missing = [m for m in import_graph() if layer_key(m) is None or layer_key(m) == "pacs_jax" and m != "pacs_jax"]
  assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_no_module_imports_a_higher_layer():
  assert violations(import_graph()) == []


def test_allow_list_holds_only_real_imports():
  graph = import_graph()
  stale = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], set())]
  assert not stale, f"these imports are gone: remove them from ALLOWED: {stale}"


@pytest.mark.parametrize("importer, source, bad", [
    ("pacs_jax.eval.runner", "from pacs_jax.train import checkpoint", True),
    ("pacs_jax.rewards.math", "def f():\n  from pacs_jax.data import synthetic", True),  # function-level too
    ("pacs_jax.data.pipeline", "import pacs_jax.models.qwen2", True),
    ("pacs_jax.models.hf", "from pacs_jax import config", True),
    ("pacs_jax.train.loop", "from pacs_jax.train import __main__", True),
    ("pacs_jax.eval.runner", "from pacs_jax.storage import export", False),
    ("pacs_jax.train.loop", "from pacs_jax.models import qwen2\nfrom pacs_jax import paths", False),
])
def test_a_backwards_import_is_caught(importer, source, bad):
  graph = {importer: imported_modules(ast.parse(source), importer)}
  assert bool(violations(graph)) == bad, violations(graph)
