"""The README's quick-start commands are the ones CI and users run."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
  text = open(os.path.join(ROOT, "README.md")).read()
  quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```bash\n(.+?)\n```", quick, re.S)


def test_quick_start_has_two_commands():
  cmds = readme_commands()
  assert len(cmds) == 2
  assert "python -m pacs_jax.train" in cmds[0]
  assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  assert readme_commands()[1] in ci.splitlines()


def test_the_tests_install_into_their_own_environment():
  """The test extras (torch, libtpu, the CUDA plugin: about 7 GB) never go into the demo's `.venv` (issue 44)."""
  demo, tests = readme_commands()
  venv = lambda cmd: re.search(r"python3 -m venv (\S+) && \. (\S+)/bin/activate", cmd).groups()
  assert venv(demo) == (".venv", ".venv") and venv(tests) == (".venv-test", ".venv-test")
  assert ".venv-test/" in open(os.path.join(ROOT, ".gitignore")).read().split()


def test_ci_tests_a_clone_with_nothing_beside_it():
  """A user's clone has no ../shared: CI runs the README's test command in a fresh clone in an empty folder,
  removed when CI ends."""
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  clone = ci.index("git clone")
  assert 'scratch="$(mktemp -d)"' in ci and 'clone="$scratch/' in ci, ci
  assert ci.index('cd "$clone"') < ci.index(readme_commands()[1]), ci
  assert """trap 'rm -rf "$scratch"' EXIT""" in ci  # the clone and its venv (7 GiB) go when CI ends
  assert clone < ci.index(readme_commands()[1])


def test_nothing_reads_the_data_folder_beside_the_repo():
  """Tests and the package read released data only from the repository (tests/fixtures/data)."""
  beside = re.compile(r"""shared['"]?\s*[,/]\s*['"]?data|\.\./shared""")
  offenders = []
  for folder in ("pacs_jax", "tests", "benchmarks", "configs", "launch", "notebooks", ".ci"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        if name.endswith((".py", ".sh", ".ipynb", ".cfg")) or folder == ".ci":
          path = os.path.join(dirpath, name)
          if path != os.path.abspath(__file__) and beside.search(open(path, errors="replace").read()):
            offenders.append(os.path.relpath(path, ROOT))
  assert not offenders, offenders
