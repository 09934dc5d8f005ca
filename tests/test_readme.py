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
