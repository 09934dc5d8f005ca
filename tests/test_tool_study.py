"""The laptop study's tool task (`python -m pacs_jax.study --task tools`, issue 43) in its shrunk mode, in this
process: PACS and GRPO from the tool demo's warmed-up base, held-out pass@k with the tool and the samples' tool-call
rate before and after, the paired differences, the call-rate column and the third curve."""

import json
import os

import numpy as np

from pacs_jax.data import synthetic_tasks as synthetic
from pacs_jax.study import heldout, report, runs
from pacs_jax.study import study_settings as settings_lib


def test_the_shrunk_tool_study_compares_pacs_and_grpo_with_the_tool(tmp_path):
  s = settings_lib.SHRUNK_TOOLS
  out, cache = str(tmp_path / "study"), str(tmp_path / "cache")
  lines = []
  result = runs.run_study(s, out, cache, log=lines.append)
  written = report.write(result, out)

  assert [(r["algorithm"], r["seed"]) for r in result["runs"]] == [("pacs", 0), ("grpo", 0)]
  # The tool demo's base, built once under the cache by the shrunk warm-up, recorded with its settings.
  assert result["warmup"]["warmup"] == settings_lib.TOOL_TASK and result["warmup"]["settings"]["steps"] == 10
  base = lines[0].removeprefix("base model: ").split(" (")[0]
  assert os.path.dirname(base).startswith(os.path.join(cache, "base-mul53_tools-"))
  built = os.path.getmtime(os.path.join(base, "warmup.json"))
  assert runs.base_model_dir(s, cache) == base and os.path.getmtime(os.path.join(base, "warmup.json")) == built
  # Held-out products, distinct, in the task's own form.
  task = synthetic.get_task("synthetic/mul53")
  assert len(set(result["held_out"])) == s.eval_problems
  assert result["held_out"] == [r["problem"] for r in heldout.problems(task, s.eval_problems, s.eval_terms)]
  assert all(p.endswith(" mod 53") for p in result["held_out"])

  for run in result["runs"]:
    for phase in ("base", "trained") if "base" in run else ("trained",):
      record = run[phase]
      assert list(record["pass_at_k"]) == [heldout.OVERALL]  # no grouping by terms: products have none
      assert list(record["pass_at_k"]["all"]) == ["1", "2", "4"]
      called = np.array(record["called"])
      assert called.shape == (s.eval_problems,) and np.all((called >= 0) & (called <= s.eval_n))
      assert record["call_rate"] == called.sum() / (s.eval_n * s.eval_problems)
    assert [row["step"] for row in run["metrics"]] == list(range(1, s.steps + 1))
    assert {"reward/mean", "tools/call_rate", "tools/turns_mean"} <= set(run["metrics"][0])
  assert "base" in result["runs"][0] and "base" not in result["runs"][1]  # the base model once per seed

  summary = result["summary"]
  assert list(summary["call_rate"]) == ["base", "grpo", "pacs"]
  assert summary["call_rate"]["pacs"]["mean"] == result["runs"][0]["trained"]["call_rate"]
  d = summary["differences"]["grpo"]["1"]
  assert d["low"] <= d["diff"] <= d["high"] and (d["n_seeds"], d["n_problems"]) == (1, s.eval_problems)
  table = open(written["table"]).read()
  assert table.startswith("| method | pass@1 | tool calls |") and "| PACS minus | pass@1 |" in table
  rate = 100 * summary["call_rate"]["grpo"]["mean"]
  assert f"| GRPO | {100 * summary['pass_at_k']['grpo']['1']['mean']:.1f} ± 0.0 | {rate:.1f} ± 0.0 |" in table
  assert os.path.getsize(written["curves"]) > 10_000
  with open(os.path.join(out, runs.RESULTS_FILE)) as f:
    assert json.load(f)["settings"]["task"] == settings_lib.TOOL_TASK


def test_docs_tool_study_table_is_the_committed_summarys():
  """docs/tools.md's tool-study tables are what the report prints from docs/tools_study_summary.json (the study's own
  file): regenerating one and not the other fails."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "tools_study_summary.json")) as f:
    result = json.load(f)
  summary = result["summary"]
  assert result["settings"] == json.loads(json.dumps(settings_lib.TOOLS.to_dict()))  # the shipped settings ran
  with open(os.path.join(root, "docs", "tools.md")) as f:
    doc = f.read()
  block = doc.split("<!-- tools_study: begin -->")[1].split("<!-- tools_study: end -->")[0]
  assert report.markdown_table(summary["pass_at_k"], calls=summary["call_rate"]).split("\n\n")[0] in block
  assert report.differences_table(summary["differences"]).split("\n\n")[0] in block
