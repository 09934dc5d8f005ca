"""One meaning per batch word (docs/design.md, "Batch vocabulary"): each word of the table is defined in the module it
names, the names they replaced do not come back to the package, and `Batch` is defined once (algos/batch.py)."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pacs_jax"
# The names the vocabulary replaced (the doc says each is gone): a class, a class, a function's call.
GONE = ("TrainBatch", "RolloutBatch", "train_batch(")


def section() -> str:
  text = (ROOT / "docs" / "design.md").read_text()
  return re.search(r"^## Batch vocabulary\n(.+?)(?=^## )", text, re.M | re.S).group(1)


def table() -> dict[str, str]:
  """{word: module path under pacs_jax/} from the section's table."""
  return dict(re.findall(r"^\| `(\w+)` \| `([\w/]+\.py)` \|", section(), re.M))


def assigned(node: ast.AST) -> list[str]:
  """The plain names an assignment (plain, annotated or a `type` alias) binds."""
  if isinstance(node, ast.Assign):
    targets = node.targets
  elif isinstance(node, ast.AnnAssign):
    targets = [node.target]
  elif isinstance(node, getattr(ast, "TypeAlias", ())):  # Python 3.12's `type X = ...`
    targets = [node.name]
  else:
    return []
  return [t.id for t in targets if isinstance(t, ast.Name)]


def defined_names(path: pathlib.Path) -> set[str]:
  """Names a module defines anywhere (functions, classes, methods, assignments)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      out.add(node.name)
    out.update(assigned(node))
  return out


def batch_definitions(source: str) -> list[int]:
  """Lines that define a name `Batch` (an assignment, an annotated one, a `type` alias, a class)."""
  return [node.lineno for node in ast.walk(ast.parse(source))
          if "Batch" in assigned(node) or isinstance(node, ast.ClassDef) and node.name == "Batch"]


def test_each_word_is_defined_where_the_table_says():
  words = table()
  assert {"Batch", "Field", "BatchLayout", "PackedRollout", "batch_layout", "batch_fields"} <= set(words), words
  missing = [f"{word} ({path})" for word, path in words.items() if word not in defined_names(PACKAGE / path)]
  assert not missing, f"the Batch vocabulary's table names these where they are not defined: {missing}"


def test_the_replaced_names_are_gone_from_the_package():
  said = section()
  assert all(f"`{name}`" in said for name in GONE), "docs/design.md names each replaced name as gone"
  found = [f"{path.relative_to(ROOT)}:{n}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1) for name in GONE
           if re.search(rf"\b{re.escape(name)}", line)]
  assert not found, "\n".join(found)


def test_batch_is_defined_once():
  found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
           for line in batch_definitions(path.read_text())]
  assert len(found) == 1 and found[0].startswith("pacs_jax/algos/batch.py:"), found


@pytest.mark.parametrize("source, lines", [
    ("Batch = dict[str, jax.Array]", [1]),
    ("import jax\nBatch: TypeAlias = dict[str, jax.Array]", [2]),
    ("class Batch(dict):\n  pass", [1]),
    ("from pacs_jax.algos.batch import Batch\nx: Batch = {}", []),
    ("MiniBatch = dict", []),
])
def test_a_second_batch_definition_is_caught(source, lines):
  assert batch_definitions(source) == lines
