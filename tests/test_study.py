"""The laptop study (`python -m pacs_jax.study`) in its shrunk mode: the files and their schema, and the same seed
giving the same metrics rows and pass@k counts bit for bit."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pacs_jax.data import synthetic_tasks as synthetic
from pacs_jax.study import report, runs
from pacs_jax.study import study_settings as settings_lib
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_shrunk_study(out, *flags) -> tuple[dict, str]:
  """The shrunk study through its command line on one CPU device, on the tests' compile cache."""
  cache = os.environ.get("PACS_JAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache"))  # as tests/conftest.py
  env = dict(os.environ, PACS_JAX_COMPILATION_CACHE=cache, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = child_env.xla_flags()  # one CPU device, as a user's laptop
  done = subprocess.run([sys.executable, "-m", "pacs_jax.study", "--shrunk", "--out", str(out), *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(out / runs.RESULTS_FILE) as f:
    return json.load(f), done.stdout


@pytest.fixture(scope="module")
def shrunk_study(tmp_path_factory):
  out = tmp_path_factory.mktemp("study")
  return (out, *run_shrunk_study(out))


def test_shrunk_study_writes_its_files_and_schema(shrunk_study):
  out, result, stdout = shrunk_study
  s = settings_lib.SHRUNK
  for name in report.FIGURE_FILES.values():
    assert os.path.getsize(out / name) > 10_000, name
  assert (out / report.TABLE_FILE).read_text().startswith("| method | pass@1 | pass@16 |")
  assert result["schema_version"] == runs.SCHEMA_VERSION and result["settings"]["steps"] == s.steps
  assert {(r["algorithm"], r["seed"]) for r in result["runs"]} == {(a, seed) for a in s.algorithms for seed in s.seeds}
  ks = [str(k) for k in (1, 2, 4, 8, 16)]
  assert len(result["held_out"]) == s.eval_problems
  for run in result["runs"]:
    assert list(run["trained"]["pass_at_k"]["all"]) == ks
    assert len(run["trained"]["correct"]) == s.eval_problems and max(run["trained"]["correct"]) <= s.eval_n
    assert [row["step"] for row in run["metrics"]] == list(range(1, s.steps + 1))
    assert {"reward/mean", "entropy"} <= set(run["metrics"][0])
  assert sorted(r["seed"] for r in result["runs"] if "base" in r) == list(s.seeds)  # the base model once per seed
  summary = result["summary"]["pass_at_k"]
  assert list(summary) == ["base", "ppo", "grpo", "pacs"]
  assert set(summary["pacs"]["1"]) == {"mean", "std", "min", "max", "n_seeds"}
  assert summary["pacs"]["1"]["n_seeds"] == len(s.seeds)
  assert set(result["summary"]["pass_at_k_by_terms"]) <= {f"{k} terms" for k in s.eval_terms}
  # PACS minus each other algorithm, paired over both seeds and every problem, at the table's ks up to eval_n.
  diffs = result["summary"]["differences"]
  assert list(diffs) == ["ppo", "grpo"] and list(diffs["grpo"]) == ["1", "16"]
  d = diffs["grpo"]["1"]
  assert d["low"] <= d["diff"] <= d["high"] and (d["n_seeds"], d["n_problems"]) == (len(s.seeds), s.eval_problems)
  expected = (np.array([r["trained"]["correct"] for r in sorted(result["runs"], key=lambda r: r["seed"])
                        if r["algorithm"] == name]) for name in ("pacs", "grpo"))
  assert d["diff"] == pytest.approx(np.subtract(*expected).mean() / s.eval_n)  # pass@1 = correct / n
  assert "| PACS minus | pass@1 | pass@16 |" in (out / report.TABLE_FILE).read_text() and "resolved" in stdout
  assert result["base_model"].startswith("base_models" + os.sep)  # relative to OUT: no machine's path
  assert "| PACS |" in stdout and "CPU min" in stdout
  assert [i["runs_trained"] for i in result["invocations"]] == [len(result["runs"])] and result["invocations"][0]["cpu_s"] > 0
  with open(out / runs.DIGEST_FILE) as f:
    assert json.load(f) == runs.digest(result)
  # No path of the machine that ran it (docs/study_summary.json is committed).
  assert str(out) not in json.dumps(runs.digest(result))
  # The held-out problems are never training problems.
  task = synthetic.get_task(s.warmup.task)
  train = {r["problem"] for r in task.records(4096, seed=0)}
  assert not train & set(result["held_out"])


def test_same_seed_same_rows_bit_for_bit(shrunk_study, tmp_path):
  """A second study of one seed and algorithm, with its own freshly warmed-up base model, reproduces every metrics
  row (but the timings) and every pass@k count of the first."""
  _, first, _ = shrunk_study
  second, _ = run_shrunk_study(tmp_path, "--seeds", "1", "--algorithms", "pacs", "--cache_dir",
                               str(tmp_path / "fresh_cache"))
  assert [(r["algorithm"], r["seed"]) for r in second["runs"]] == [("pacs", 1)]
  assert second["warmup"]["final_loss"] == first["warmup"]["final_loss"]
  before = {(r["algorithm"], r["seed"]): r for r in first["runs"]}
  for run in second["runs"]:
    old = before[(run["algorithm"], run["seed"])]
    assert runs.deterministic_rows(run["metrics"]) == runs.deterministic_rows(old["metrics"])
    assert run["trained"] == old["trained"]
    assert run.get("base") == old.get("base")


def test_held_out_problems_are_distinct_and_graded():
  task = synthetic.get_task("synthetic/sum11")
  held = task.held_out(60, terms=(2, 3, 4))
  assert len({r["problem"] for r in held}) == 60 and all(task.is_held_out(r["problem"]) for r in held)
  assert {synthetic.num_terms(r["problem"]) for r in held} == {2, 3, 4}
  assert all(task.score(str(int(r["answer"]) + 11), r["answer"]) == 1.0 for r in held)  # any representative
  with pytest.raises(ValueError, match="distinct"):
    task.held_out(10, terms=(1,))  # 11 one-term problems, about a quarter held out


def test_study_runs_train_on_their_task_without_advisories():
  """The base model is made for the synthetic task and its tokenizer: no "real model on the synthetic task" warning."""
  from pacs_jax import config as config_lib
  for algorithm in settings_lib.all_algorithms():
    cfg = settings_lib.train_config(algorithm, 0, "base_model_dir", settings_lib.SHRUNK)
    config_lib.validate(cfg, num_devices=1, check_paths=False)
    assert config_lib.advisories(cfg) == []


def test_spread_and_table_by_hand():
  result = {"runs": [
      {"algorithm": "pacs", "seed": 0, "base": {"pass_at_k": {"all": {"1": 0.1, "2": 0.2}}},
       "trained": {"pass_at_k": {"all": {"1": 0.3, "2": 0.5}}}},
      {"algorithm": "pacs", "seed": 1, "base": {"pass_at_k": {"all": {"1": 0.3, "2": 0.4}}},
       "trained": {"pass_at_k": {"all": {"1": 0.5, "2": 0.5}}}}]}
  summary = report.pass_at_k_summary(result)
  assert list(summary) == ["base", "pacs"]
  np.testing.assert_allclose([summary["pacs"]["1"]["mean"], summary["pacs"]["1"]["std"]], [0.4, np.sqrt(0.02)])
  table = report.markdown_table(summary, ks=(1, 2, 256))
  assert "| PACS | 40.0 ± 14.1 | 50.0 ± 0.0 |" in table and "pass@256" not in table
  # The base model's headroom check (the full study exits 1 without it): pass@1 0.2 and pass@2 0.3 < 2 x 0.2.
  assert "under 2x its pass@1" in report.headroom_problem(summary)
  assert report.headroom_problem({"base": {"1": {"mean": 0.11}, "256": {"mean": 0.88}}}) is None
  assert "not below 0.3" in report.headroom_problem({"base": {"1": {"mean": 0.3}, "256": {"mean": 0.9}}})


def test_algorithms_flag_takes_every_registered_objective():
  assert settings_lib.algorithms_from_flag(["gspo", "pacs"]) == ("pacs", "gspo")
  every = settings_lib.algorithms_from_flag(["all"])
  assert every[:3] == settings_lib.ALGORITHMS and {"dapo", "drgrpo", "gspo"} <= set(every)
  with pytest.raises(ValueError, match=r"\['sft'\] not among the registered"):
    settings_lib.algorithms_from_flag(["pacs", "sft"])


def test_more_seeds_or_algorithms_add_runs_to_a_study(tmp_path):
  """A study in OUT is kept when only its algorithms or seeds differ (its runs stay, the new ones are added);
  any other setting starts a new one."""
  s = settings_lib.SHRUNK
  path = tmp_path / runs.RESULTS_FILE
  runs.write_json(str(path), {"schema_version": runs.SCHEMA_VERSION, "settings": s.to_dict(), "runs": ["kept"]})
  more = dataclasses.replace(s, algorithms=("pacs", "gspo"), seeds=(1, 5))
  previous = runs._previous(str(path), more)
  assert previous["runs"] == ["kept"]
  merged = runs._with_runs_of(previous["settings"], more)
  assert merged["algorithms"] == ["pacs", "grpo", "ppo", "gspo"] and merged["seeds"] == [0, 1, 5]
  assert runs._previous(str(path), dataclasses.replace(s, steps=3)) is None


def test_committed_tables_are_the_committed_summarys():
  """docs/study.md's and the README's pass@k tables are what the report prints from docs/study_summary.json (the
  study's own file), and docs/study.md's differences are the summary's: regenerating one and not the others fails."""
  with open(os.path.join(ROOT, "docs", "study_summary.json")) as f:
    summary = json.load(f)["summary"]
  table = report.markdown_table(summary["pass_at_k"]).split("\n\n")[0]
  differences = report.differences_table(summary["differences"]).split("\n\n")[0]
  for doc in ("README.md", os.path.join("docs", "study.md")):
    with open(os.path.join(ROOT, doc)) as f:
      assert table in f.read(), f"{doc}'s study table is not docs/study_summary.json's: regenerate it"
  with open(os.path.join(ROOT, "docs", "study.md")) as f:
    assert differences in f.read()
