"""The model room knows no task: checkpoint I/O is weights and config.json, and nothing under pacs_jax/models imports
pacs_jax.data (a model directory's tokenizer and generation config are `pacs_jax.data.tokenizers`')."""

import ast
import pathlib

MODELS = pathlib.Path(__file__).resolve().parents[2] / "pacs_jax" / "models"


def imports(tree: ast.AST) -> set[str]:
  """Every module (or module.name) a module imports, function-level imports included."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level:
      out |= {f"{node.module}.{a.name}" for a in node.names}
  return out


def test_no_model_module_imports_the_data_room():
  found = {str(path.relative_to(MODELS.parent)): sorted(name for name in imports(ast.parse(path.read_text()))
                                                        if name.startswith("pacs_jax.data."))
           for path in sorted(MODELS.rglob("*.py"))}
  assert {path: names for path, names in found.items() if names} == {}
