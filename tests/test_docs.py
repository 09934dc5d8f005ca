"""The README and docs/: short README, every link resolves, and every command they show names a real module, its
real flags and real config fields (the commands themselves run in tests/train/test_first_hour.py)."""

import glob
import importlib.util
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# absl's own flags, accepted by every CLI.
ABSL_FLAGS = {"help", "helpfull", "verbosity", "v", "logtostderr", "alsologtostderr"}


def test_readme_is_short():
  assert len(open(DOCS[0]).read().splitlines()) <= 150


@pytest.mark.parametrize("doc", DOCS, ids=os.path.basename)
def test_links_resolve(doc):
  text = open(doc).read()
  for target in LINK.findall(text):
    if re.match(r"[a-z]+://", target):
      continue  # web addresses are not checked offline
    path = target.split("#", 1)[0]
    assert os.path.exists(os.path.join(os.path.dirname(doc), path)), f"{os.path.relpath(doc, ROOT)}: {target}"


def test_every_doc_is_linked_from_the_readme():
  readme = open(DOCS[0]).read()
  for doc in DOCS[1:]:
    assert f"docs/{os.path.basename(doc)}" in readme, doc


def test_no_reference_to_files_outside_the_repository():
  for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True) + DOCS + \
      glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")):
    if ".venv" in path or "/tests/test_docs.py" in path:
      continue
    assert "PACS.md" not in open(path).read(), f"{path}: PACS.md is docs/algorithm.md in this repository"


def shown_commands() -> list[tuple[str, list[str]]]:
  """(doc, argv) of every `python -m pacs_jax...` line in a bash block (continuations joined, comments cut)."""
  out = []
  for doc in DOCS:
    for block in re.findall(r"```bash\n(.+?)\n```", open(doc).read(), re.S):
      for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
          words = shlex.split(part, comments=True)
          if len(words) > 2 and words[:2] == ["python", "-m"] and words[2].startswith("pacs_jax"):
            out.append((os.path.basename(doc), words[2:]))
  return out


def defined_flags(module: str) -> set[str]:
  path = importlib.util.find_spec(module).origin
  if os.path.basename(path) == "__init__.py":  # a package's command line (pacs_jax.study)
    path = os.path.join(os.path.dirname(path), "__main__.py")
  source = open(path).read()
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
  names |= set(re.findall(r"define_config_file\(\s*\"\w+\",\s*\"(\w+)\"", source))  # pacs_jax.errors' wrapper
  if module == "pacs_jax.evaluate":
    from pacs_jax import evaluate
    names |= set(evaluate.CONFIG_FLAGS)
  return names | ABSL_FLAGS


def config_of(argument: str):
  """A `--config path[:variant]` argument's config, as the train CLI builds it."""
  path, _, variant = argument.partition(":")
  spec = importlib.util.spec_from_file_location("_doc_config", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def test_shown_commands_use_real_modules_flags_and_fields():
  commands = shown_commands()
  assert {argv[0] for _, argv in commands} >= {"pacs_jax.train", "pacs_jax.evaluate", "pacs_jax.export",
                                               "pacs_jax.compare"}
  from pacs_jax import config as config_lib
  for doc, argv in commands:
    module, args = argv[0], argv[1:]
    assert importlib.util.find_spec(module) is not None, (doc, argv)
    flags = defined_flags(module)
    config_argument = next((a.split("=", 1)[1] if "=" in a else args[i + 1]
                            for i, a in enumerate(args) if a.split("=")[0] == "--config"), "configs/tiny_cpu.py")
    for arg in args:
      if not arg.startswith("--"):
        continue
      name = arg[2:].split("=", 1)[0]
      if name.startswith("config."):
        assert module == "pacs_jax.train", (doc, argv)
        config_lib.get_field(config_of(config_argument), name[len("config."):])  # KeyError: no such field
      else:
        assert name in flags, f"{doc}: {module} has no --{name}"


def test_compile_tables_are_where_the_benchmark_writes_them():
  """benchmarks/compile_configs.py rewrites the text between its markers in docs/tpu.md and docs/gpu.md."""
  spec = importlib.util.spec_from_file_location("compile_configs", os.path.join(ROOT, "benchmarks", "compile_configs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for kind, (begin, end) in module.MARKERS.items():
    text = open(module.DOCS[kind]).read()
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end), kind
    assert begin not in open(DOCS[0]).read()


def test_every_gpu_marked_test_is_listed_with_the_command_to_run_it():
  """The tests that need a real GPU (skipped here) are named in docs/gpu.md beside the command that runs them."""
  gpu_doc = open(os.path.join(ROOT, "docs", "gpu.md")).read()
  assert "-m gpu" in gpu_doc and "JAX_PLATFORMS=cuda" in gpu_doc
  marked = []
  for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
    lines = open(path).read().splitlines()
    for i, line in enumerate(lines):
      if line.strip() == "@pytest.mark.gpu":
        name = next(re.match(r"def (\w+)", l).group(1) for l in lines[i + 1:] if l.startswith("def "))
        marked.append(f"{os.path.relpath(path, ROOT)}::{name}")
  assert marked
  missing = [t for t in marked if t not in gpu_doc.replace("\n", "")]
  assert not missing, f"gpu-marked tests not listed in docs/gpu.md: {missing}"


def test_training_docs_show_how_to_simulate_cpu_devices():
  """Issue 44: a user trying a split or a mesh on a laptop finds how to simulate 8 CPU devices where the split is
  described."""
  text = open(os.path.join(ROOT, "docs", "training.md")).read()
  bullet = text[text.index("- `rollout.devices=k`"):].split("\n- ", 1)[0]
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu" in bullet
  assert "--config.mesh.fsdp=-1" in bullet
