"""One meaning per shape letter across the package (issue 24): every `Shapes:` line of a docstring or comment
gives each letter the meaning docs/shapes.md gives it, and every bracketed shape ([B, T, D]) in a docstring or a
comment uses only the glossary's letters."""

import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pacs_jax"
# Words too common in a meaning to tell two meanings apart.
STOP = {"of", "the", "a", "an", "in", "to", "one", "per", "rows", "positions", "length", "size", "each", "and",
        "or", "its", "is", "it", "up", "all", "as", "by", "from", "with", "for"}


def glossary() -> dict[str, str]:
  """{letter: meaning} from docs/shapes.md's table."""
  rows = re.findall(r"^\| `([A-Z])` \| (.+?) \|", (ROOT / "docs" / "shapes.md").read_text(), re.M)
  return dict(rows)


def words(text: str) -> set[str]:
  return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOP}


def expression(text: str) -> str:
  return re.sub(r"[\s`]", "", text)


def texts(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, text) of each comment and triple-quoted string of a module: a comment run is one text."""
  out, run = [], None
  for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip("#").strip()
      if run and run[0] + run[2] == tok.start[0]:
        run = (run[0], run[1] + " " + text, run[2] + 1)
      else:
        run and out.append(run[:2])
        run = (tok.start[0], text, 1)
    elif tok.type == tokenize.STRING and re.match(r'^[rbfuRBFU]*("""|\'\'\')', tok.string):
      out.append((tok.start[0], tok.string))
  run and out.append(run[:2])
  return out


def shapes_definitions(text: str) -> list[tuple[str, str]]:
  """(letter, meaning) of each item of each `Shapes:` line in `text` (to the end of its sentence)."""
  out = []
  for m in re.finditer(r"Shapes(?: \([^)]*\))?:\s*(.+?)(?:\.\s|\.$|\"\"\"|\n\s*\n|$)", text, re.S):
    for item in re.split(r"[,;]", " ".join(m.group(1).split())):
      d = re.match(r"^([A-Z])\b(?!\s*\[)\s*(=)?\s*(.*)$", item.strip())
      if d:
        out.append((d.group(1), d.group(3)))
  return out


def meaning_matches(letter: str, meaning: str, table: dict[str, str]) -> bool:
  if letter not in table:
    return False
  if expression(meaning) and expression(meaning) in expression(table[letter]):
    return True
  return bool(words(meaning) & words(table[letter]))


def violations(path: pathlib.Path, table: dict[str, str], root: pathlib.Path = ROOT) -> list[str]:
  out, name = [], path.relative_to(root)
  for line, text in texts(path):
    for letter, meaning in shapes_definitions(text):
      if not meaning_matches(letter, meaning, table):
        out.append(f"{name}:{line}: Shapes: {letter} {meaning!r} (docs/shapes.md: "
                   f"{table.get(letter, 'no such letter')})")
    for shape in re.findall(r"\[([A-Za-z0-9_ ,+*/\-]+)\]", text):
      parts = [p.strip() for p in shape.split(",")]
      if len(parts) < 2 and not re.fullmatch(r"[A-Z]", shape.strip()):
        continue  # an index or a word in brackets, not a shape
      for letter in re.findall(r"\b[A-Z]\b", shape):
        if letter not in table:
          out.append(f"{name}:{line}: [{shape}] uses {letter}, not a docs/shapes.md letter")
  return out


def test_the_glossary_gives_each_letter_one_meaning():
  table = glossary()
  assert len(table) >= 20 and set("BTSLPRCDFVNKGHUQAMJZ") <= set(table), table


def test_every_module_uses_the_glossarys_letters():
  table = glossary()
  found = [v for path in sorted(PACKAGE.rglob("*.py")) for v in violations(path, table)]
  assert not found, "\n".join(found)


@pytest.mark.parametrize("source,ok", [
    ('"""Shapes: B batch rows, T query positions, S key positions."""', True),
    ('"""Shapes: S slots, L cache rows per slot."""', False),  # S means key positions
    ('"""Shapes: B responses = U prompts x n, R response positions."""', True),
    ('"""Shapes: N responses = G groups x n, T response positions."""', False),
    ('"""Shapes: B batch, G = N // K, L = P + R tokens."""', True),
    ("# the window [B, K, W, H] a dense decode read", False),  # W is no letter of the glossary
    ("x = 1  # [B, T, D]", True),
])
def test_the_check_tells_a_glossary_letter_from_another_meaning(tmp_path, source, ok):
  path = tmp_path / "module.py"
  path.write_text(source + "\n")
  found = violations(path, glossary(), root=tmp_path)
  assert (not found) == ok, found
