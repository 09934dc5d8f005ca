"""Imports point one way: no module under pacs_jax/ imports from a layer above its own (issue 13)."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pacs_jax"

# The layer of each top-level module or package of pacs_jax (the longest matching prefix wins). A module may
# import its own package and any lower layer; never a higher layer, nor another package of its own layer.
LAYERS = {
    # The package's __init__: it imports nothing of the package. The public API it offers (`pacs_jax.train`,
    # `pacs_jax.load_pretrained`...) names modules of every layer in a table and imports each on first use (module
    # __getattr__): every module imports `pacs_jax` first, which must not pull in the layers above it
    # (test_the_public_api_is_imported_on_first_use).
    "pacs_jax": 0,
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
    "pacs_jax.compile": 8,  # --compile_only / --dry_run: compiles the trainer's programs, so above train
    "pacs_jax.api": 8,  # the public API's own functions (load_config, load_pretrained, generate) over the library
    "pacs_jax.study": 8,  # the laptop study: runs the trainer and the pass@k estimator side by side
    # The command lines, at the top.
    "pacs_jax.train.__main__": 9,
    "pacs_jax.evaluate": 9,
    "pacs_jax.export": 9,
    "pacs_jax.compare": 9,
    "pacs_jax.study.__main__": 9,
}

# Packages of one layer that may import each other: {(importer, imported): why}.
PEERS: dict[tuple[str, str], str] = {}

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


def stale_peers(graph: dict[str, set[str]], peers) -> list[tuple[str, str]]:
  """The (importer, imported) package pairs of `peers` across which no module of `graph` imports any more."""
  crossings = {(layer_key(importer), layer_key(target)) for importer, targets in graph.items() for target in targets}
  return [pair for pair in peers if pair not in crossings]


def test_peers_hold_only_real_imports():
  stale = stale_peers(import_graph(), PEERS)
  assert not stale, f"no module imports across these pairs any more: remove them from PEERS: {stale}"


def test_a_stale_peer_is_caught():
  graph = import_graph()
  assert stale_peers(graph, {("pacs_jax.rollout", "pacs_jax.algos"): "gone"}) == [("pacs_jax.rollout", "pacs_jax.algos")]
  assert stale_peers(graph, {("pacs_jax.train", "pacs_jax.algos"): "a real import"}) == []


@pytest.mark.parametrize("importer, source, bad", [
    ("pacs_jax.eval.runner", "from pacs_jax.train import checkpoint", True),
    ("pacs_jax.rewards.math", "def f():\n  from pacs_jax.data import synthetic", True),  # function-level too
    ("pacs_jax.data.pipeline", "import pacs_jax.models.qwen2", True),
    ("pacs_jax.models.hf", "from pacs_jax import config", True),
    ("pacs_jax.train.loop", "from pacs_jax.train import __main__", True),
    ("pacs_jax.train.loop", "from pacs_jax.compile import aot", True),  # the trainer never needs compile analysis
    ("pacs_jax.compile.aot", "from pacs_jax.train import programs", False),
    ("pacs_jax.eval.runner", "from pacs_jax.storage import export", False),
    ("pacs_jax.train.loop", "from pacs_jax.models import qwen2\nfrom pacs_jax import paths", False),
])
def test_a_backwards_import_is_caught(importer, source, bad):
  graph = {importer: imported_modules(ast.parse(source), importer)}
  assert bool(violations(graph)) == bad, violations(graph)


MAX_LINES = 400  # a module longer than this holds more than one idea: split it (issue 24)
# Modules still over the limit, each with the reason: {path relative to pacs_jax/: why}.
LONG: dict[str, str] = {}


def test_no_module_is_over_400_lines():
  lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
  long = sorted(f"{path} ({n} lines)" for path, n in lengths.items() if n > MAX_LINES and path not in LONG)
  assert not long, f"split these modules (at most {MAX_LINES} lines each): {long}"
  stale = [path for path in LONG if lengths.get(path, 0) <= MAX_LINES]
  assert not stale, f"these modules are short now: remove them from LONG: {stale}"


def test_the_public_api_is_imported_on_first_use():
  """`pacs_jax/__init__.py` imports no module of the package, and importing it loads neither jax nor the trainer;
  every public name resolves."""
  assert import_graph()["pacs_jax"] == set()
  probe = ("import sys, pacs_jax; heavy = [m for m in ('jax', 'pacs_jax.train.loop', 'pacs_jax.models') "
           "if m in sys.modules]; assert not heavy, heavy; import pacs_jax.paths; "
           "assert all(getattr(pacs_jax, name) is not None for name in pacs_jax.__all__)")
  subprocess.run([sys.executable, "-c", probe], check=True, cwd=PACKAGE.parent)
