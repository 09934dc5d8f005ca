"""The house's shape (issues 13, 24, 30, 33, 41): imports point one way (no module under pacs_jax/ imports from a
layer above its own), no import cycle, no module over 400 lines, no two modules of one name, no block of six lines
written twice, and nothing outside rollout/ imports the rollout engine's internals (only its interface)."""

import ast
import collections
import pathlib
import re
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
    "pacs_jax.gcs_retries": 1,  # gcsfs with the retry count, loaded on the first gs:// path
    "pacs_jax.plugins": 0,  # functions named in a config ("package.module:function")
    "pacs_jax.sharding": 1,  # meshes and partition rules
    "pacs_jax.gpu_targets": 1,  # GPU target descriptions and their abstract devices
    "pacs_jax.rewards": 1,  # verifiers: import neither models nor train
    "pacs_jax.data": 2,  # records, prompts, the Grain pipeline (the synthetic tasks' verifier is in rewards)
    "pacs_jax.models": 3,
    "pacs_jax.envs": 3,  # tool-integrated RL: the sandbox, conversations (over data rows, scored by rewards)
    "pacs_jax.rollout": 4,
    "pacs_jax.algos": 4,
    "pacs_jax.config": 5,  # the run config: its enums come from algos, run -> model config uses models
    "pacs_jax.storage": 6,  # workdir layout, checkpoints, lock, export: shared by train and eval
    # A run's services (console, metrics, tracking, health, preemption, teardown, multihost, runtime): below the
    # trainer, which uses them, and the command lines' error handling (errors), which reads the health stop.
    "pacs_jax.services": 7,
    "pacs_jax.trainer": 8,
    "pacs_jax.eval": 8,
    "pacs_jax.errors": 8,  # expected failures -> one line and an exit status, for the command lines
    "pacs_jax.compile": 9,  # --compile_only / --dry_run: compiles the trainer's programs, so above train
    "pacs_jax.api": 9,  # the public API's own functions (load_config, load_pretrained, generate) over the library
    "pacs_jax.study": 9,  # the laptop study (runs the trainer and the pass@k estimator) and its runs-comparing tool
    # The command lines, at the top (a package's __main__ is its package's: it imports nothing above the package).
    "pacs_jax.train": 10,
    "pacs_jax.evaluate": 10,
    "pacs_jax.export": 10,
    "pacs_jax.compare": 10,
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
      if "__main__" in target.split("."):  # a command line is run, never imported
        out.append(f"{importer} imports {target}: a command line")
      elif dst is None or src == dst or dst == "pacs_jax" and target != "pacs_jax":
        continue
      elif (importer, target) in ALLOWED or (src, dst) in PEERS:
        continue
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
  assert stale_peers(graph, {("pacs_jax.trainer", "pacs_jax.algos"): "a real import"}) == []


@pytest.mark.parametrize("importer, source, bad", [
    ("pacs_jax.eval.runner", "from pacs_jax.trainer import checkpoint", True),
    ("pacs_jax.rewards.math", "def f():\n  from pacs_jax.data import synthetic_tasks", True),  # function-level too
    ("pacs_jax.data.pipeline", "import pacs_jax.models.qwen2", True),
    ("pacs_jax.models.hf", "from pacs_jax import config", True),
    ("pacs_jax.trainer.loop", "from pacs_jax.trainer import __main__", True),
    ("pacs_jax.trainer.loop", "from pacs_jax.compile import aot", True),  # the trainer never needs compile analysis
    ("pacs_jax.trainer.loop", "from pacs_jax import train", True),  # nor its command line
    ("pacs_jax.study.__main__", "from pacs_jax.compile import aot", True),  # a package's command line: its layer
    ("pacs_jax.compile.aot", "from pacs_jax.trainer import programs", False),
    ("pacs_jax.eval.runner", "from pacs_jax.storage import hf_export", False),
    ("pacs_jax.services.metrics", "from pacs_jax.trainer import stages", True),  # the services sit below the trainer
    ("pacs_jax.errors", "from pacs_jax.services import health", False),
    ("pacs_jax.trainer.loop", "from pacs_jax.models import qwen2\nfrom pacs_jax import paths", False),
])
def test_a_backwards_import_is_caught(importer, source, bad):
  graph = {importer: imported_modules(ast.parse(source), importer)}
  assert bool(violations(graph)) == bad, violations(graph)


# -- the rollout interface (issue 33) ----------------------------------------------------------------------------

# What modules outside pacs_jax/rollout/ may import of it: the interface, its in-process implementation, the
# sampling methods and stop-token sets a caller chooses, the page-budget sizing `--compile_only` reads, and the
# split-device placement (`placement.SplitRollout`, another implementation). The engine, its scheduler, state and
# programs are the implementation's own.
ROLLOUT_PUBLIC = {"interface", "local", "sampling", "stop_tokens", "budget", "placement"}


def rollout_internals_imported(graph: dict[str, set[str]]) -> list[str]:
  """Each import, by a module outside pacs_jax.rollout, of a rollout module that is not in ROLLOUT_PUBLIC."""
  out = []
  for importer, targets in sorted(graph.items()):
    if importer == "pacs_jax.rollout" or importer.startswith("pacs_jax.rollout."):
      continue
    for target in sorted(targets):
      parts = target.split(".")
      if parts[:2] == ["pacs_jax", "rollout"] and len(parts) > 2 and parts[2] not in ROLLOUT_PUBLIC:
        out.append(f"{importer} imports {target}")
  return out


def test_only_the_rollout_interface_is_imported_from_outside():
  found = rollout_internals_imported(import_graph())
  assert not found, f"go through pacs_jax.rollout.interface (or local.LocalRollout): {found}"


@pytest.mark.parametrize("importer, source, bad", [
    ("pacs_jax.trainer.loop", "from pacs_jax.rollout import scheduler", True),
    ("pacs_jax.eval.runner", "def f():\n  from pacs_jax.rollout import engine as engine_lib", True),
    ("pacs_jax.compile.aot", "from pacs_jax.rollout.engine import Engine", True),
    ("pacs_jax.trainer.stages", "import pacs_jax.rollout.decode_state", True),
    ("pacs_jax.trainer.stages", "from pacs_jax.rollout.interface import Completion", False),
    ("pacs_jax.api", "from pacs_jax.rollout import local, sampling, stop_tokens", False),
    ("pacs_jax.rollout.local", "from pacs_jax.rollout import scheduler", False),  # inside: its own
])
def test_an_import_of_rollout_internals_is_caught(importer, source, bad):
  graph = {importer: imported_modules(ast.parse(source), importer)}
  assert bool(rollout_internals_imported(graph)) == bad


MAX_LINES = 400  # a module longer than this holds more than one idea: split it (issue 24)
# Modules still over the limit, each with the reason: {path relative to pacs_jax/: why}.
LONG: dict[str, str] = {}


def test_no_module_is_over_400_lines():
  lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
  long = sorted(f"{path} ({n} lines)" for path, n in lengths.items() if n > MAX_LINES and path not in LONG)
  assert not long, f"split these modules (at most {MAX_LINES} lines each): {long}"
  stale = [path for path in LONG if lengths.get(path, 0) <= MAX_LINES]
  assert not stale, f"these modules are short now: remove them from LONG: {stale}"


# -- module names (issue 41) -------------------------------------------------------------------------------------

# A package's __init__ and __main__ are its own: every package has them by the same name.
PACKAGE_FILES = {"__init__.py", "__main__.py"}


def shared_names(paths: list[pathlib.PurePath]) -> dict[str, list[str]]:
  """{module file name: its paths} for each name that more than one module under pacs_jax/ has."""
  by_name = collections.defaultdict(list)
  for path in paths:
    if path.name not in PACKAGE_FILES:
      by_name[path.name].append(str(path))
  return {name: sorted(places) for name, places in sorted(by_name.items()) if len(places) > 1}


def test_no_two_modules_share_a_name():
  """A name says which module it is without its package (`state`: the trainer's or the rollout's?): each module's
  file name is its own."""
  shared = shared_names([p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")])
  assert not shared, f"rename one of each (a name that says what it holds): {shared}"


def test_a_shared_module_name_is_caught():
  paths = [pathlib.PurePath(p) for p in ("__init__.py", "train.py", "trainer/__init__.py", "trainer/state.py",
                                          "rollout/__init__.py", "rollout/state.py", "study/__main__.py")]
  assert shared_names(paths) == {"state.py": ["rollout/state.py", "trainer/state.py"]}


def test_the_public_api_is_imported_on_first_use():
  """`pacs_jax/__init__.py` imports no module of the package, and importing it loads neither jax nor the trainer;
  every public name resolves."""
  assert import_graph()["pacs_jax"] == set()
  probe = ("import sys, pacs_jax; heavy = [m for m in ('jax', 'pacs_jax.trainer.loop', 'pacs_jax.models') "
           "if m in sys.modules]; assert not heavy, heavy; import pacs_jax.paths; "
           "assert all(getattr(pacs_jax, name) is not None for name in pacs_jax.__all__)")
  subprocess.run([sys.executable, "-c", probe], check=True, cwd=PACKAGE.parent)


# -- cycles ------------------------------------------------------------------------------------------------------


def module_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """Import edges between modules of pacs_jax (a name imported from a module counts as an import of the module;
  function-level and TYPE_CHECKING imports count too). A package's __init__ imported on the way to one of its
  modules is not an edge: only what the code names."""
  def module_of(target: str) -> str | None:
    while target not in graph and "." in target:
      target = target.rsplit(".", 1)[0]
    return target if target in graph else None
  return {m: {module_of(t) for t in targets} - {None, m} for m, targets in graph.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for nxt in graph.get(todo.pop(), ()):
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
  """The modules of each import cycle (modules that import each other, directly or through others), sorted."""
  reach = {m: reachable(graph, m) for m in graph}
  return sorted({tuple(sorted(n for n in reach[m] if m in reach[n])) for m in graph if m in reach[m]})


def test_no_import_cycle():
  found = cycles(module_graph(import_graph()))
  assert not found, f"these modules import each other (move what both need below them): {found}"


@pytest.mark.parametrize("sources, cycle", [
    ({"pacs_jax.algos.batch": "from pacs_jax.algos import algorithms",
      "pacs_jax.algos.algorithms": "from pacs_jax.algos.batch import BatchLayout"},
     ("pacs_jax.algos.algorithms", "pacs_jax.algos.batch")),
    ({"pacs_jax.a": "from pacs_jax import b",
      "pacs_jax.b": "def f():\n  import pacs_jax.c",  # function-level
      "pacs_jax.c": "import typing\nif typing.TYPE_CHECKING:\n  from pacs_jax.a import T"},  # for type hints
     ("pacs_jax.a", "pacs_jax.b", "pacs_jax.c")),
    ({"pacs_jax.config": "from pacs_jax.config.checks import validate",
      "pacs_jax.config.checks": "def f():\n  from pacs_jax.config import default_config"},  # the package itself
     ("pacs_jax.config", "pacs_jax.config.checks")),
    ({"pacs_jax.config": "from pacs_jax.config.checks import validate",  # a package importing its modules,
      "pacs_jax.config.checks": "from pacs_jax.config import files",  # which import each other
      "pacs_jax.config.files": "import os"}, None),
])
def test_an_import_cycle_is_caught(sources, cycle):
  graph = {m: imported_modules(ast.parse(source), m) for m, source in sources.items()}
  assert cycles(module_graph(graph)) == ([cycle] if cycle else [])


# -- repeated blocks ---------------------------------------------------------------------------------------------

BLOCK = 6  # code lines: a block this long written twice is a function missing (issue 30)
# Lines that say nothing of their own: blank, a comment, brackets and separators alone, a docstring's quotes.
_EMPTY = re.compile(r"""[\s()\[\]{},:;]*|#.*|[rRbBuU]?("{3}|'{3})""")


def code_lines(text: str) -> list[tuple[int, str]]:
  """(line number, the line with its whitespace collapsed) of each line that says something. Imports are left out:
  each module states its own, and two modules of one family may well need the same ones."""
  out = []
  for number, line in enumerate(text.splitlines(), 1):
    line = " ".join(line.split())
    if not _EMPTY.fullmatch(line) and not line.startswith(("import ", "from ")):
      out.append((number, line))
  return out


def repeated_blocks(texts: dict[str, str], block: int = BLOCK) -> list[str]:
  """Each run of `block` or more code lines found more than once (across modules or within one): its places."""
  seen = collections.defaultdict(list)  # block of lines -> [(path, index in the path's code lines)]
  lines = {path: code_lines(text) for path, text in texts.items()}
  for path, numbered in lines.items():
    for i in range(len(numbered) - block + 1):
      seen[tuple(line for _, line in numbered[i:i + block])].append((path, i))
  repeats = [places for places in seen.values() if len(places) > 1]
  starts = {tuple(places) for places in repeats}
  out = []
  for places in repeats:  # a longer run is one entry: a block one line further on in every place continues it
    if tuple((path, i - 1) for path, i in places) not in starts:
      out.append(" = ".join(f"{path}:{lines[path][i][0]}" for path, i in places))
  return sorted(out)


def test_no_block_of_six_lines_is_repeated():
  texts = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
  found = repeated_blocks(texts)
  assert not found, f"blocks of {BLOCK}+ lines written twice (make each one function): {found}"


_BODY = ("  total = 0\n  for row in rows:\n    total += row.weight * row.score\n  if not rows:\n    return None\n"
         "  mean = total / len(rows)\n")


@pytest.mark.parametrize("texts, found", [
    # one body in two modules, reindented, with a comment and blank lines in one of them
    ({"a.py": "def f(rows):\n" + _BODY, "b.py": "def g(rows):\n\n  # the same\n" + _BODY.replace("  ", "    ")},
     ["a.py:2 = b.py:4"]),
    ({"a.py": "def f(rows):\n" + _BODY + "  return mean\n\n\ndef g(rows):\n" + _BODY + "  return -mean\n"},
     ["a.py:2 = a.py:12"]),  # twice in one module
    ({"a.py": "def f(rows):\n" + _BODY + "  return mean\n", "b.py": "x = 1\n" + _BODY + "  return mean\n"},
     ["a.py:2 = b.py:2"]),  # seven lines repeated: one entry
    ({"a.py": _BODY.replace("  mean = total / len(rows)\n", ""), "b.py": _BODY.replace("  total = 0\n", "")}, []),
    # tables of the same shape and different entries (the public API's, evaluate's flags) are no repeat
    ({"a.py": "".join(f'  "n{i}": ("pacs_jax.m{i}", "f{i}"),\n' for i in range(8)),
      "b.py": "".join(f'  "flag{i}": ("rollout.f{i}", "help {i}"),\n' for i in range(8))}, []),
    ({"a.py": "".join(f"import m{i}\n" for i in range(8)), "b.py": "".join(f"import m{i}\n" for i in range(8))}, []),
])
def test_a_repeated_block_is_caught(texts, found):
  assert repeated_blocks(texts) == found
