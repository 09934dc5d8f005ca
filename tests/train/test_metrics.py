"""metrics.jsonl after a kill: the next start keeps exactly the rows before the step it logs first."""

import json

from pacs_jax.services import metrics


def write(path, text):
  path.write_text(text)
  return str(path)


def steps(path):
  return [json.loads(line)["step"] for line in open(path)]


ROWS = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(6))


def test_resuming_drops_rows_after_the_checkpoint_and_a_cut_off_line(tmp_path):
  path = write(tmp_path / "metrics.jsonl", ROWS + '{"step": 6, "lo')
  metrics.repair(path, first_step=4)  # resumed from the checkpoint of step 3
  assert steps(path) == [0, 1, 2, 3]
  assert open(path).read().endswith("}\n")


def test_a_fresh_start_drops_every_row(tmp_path):
  """A run killed after logging step 0's validation but before its first checkpoint logs step 0 again."""
  path = write(tmp_path / "metrics.jsonl", ROWS)
  metrics.repair(path, first_step=0)
  assert open(path).read() == ""


def test_a_clean_file_is_left_as_it_is(tmp_path):
  path = write(tmp_path / "metrics.jsonl", ROWS)
  metrics.repair(path, first_step=6)
  assert open(path).read() == ROWS


def test_read_rows_skips_a_partial_line(tmp_path):
  path = write(tmp_path / "metrics.jsonl", ROWS + '{"step"')
  assert [r["step"] for r in metrics.read_rows(path)] == list(range(6))


def test_the_console_line_keeps_non_finite_values(tmp_path, capsys):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "entropy": 1.5, "reward/mean": 0.25})
  writer.close()
  assert "reward=0.25  entropy=1.5  loss=nan  grad_norm=inf" in capsys.readouterr().out
  assert json.loads(open(tmp_path / "metrics.jsonl").read())["loss"] == "nan"


BAD_LINES = ['{"step": 1e400, "loss": 0.5}', '{"step": 2, "loss": NaN}', '{"step": 2, "loss": Infinity}',
             '{"step": "2", "loss": 0.5}', '{"step": true}', '{"step": -1}', '[1, 2]', '5', 'null', '"text"',
             '{"loss": 0.5}', '{"step": 2}{"step": 3}', '\xff\xfe garbage']


def test_a_damaged_or_edited_line_never_stops_a_resume(tmp_path, caplog):
  """Issue 34: any line that is not one finite-valued JSON row is set aside in metrics.jsonl.bad with one warning
  naming the file and the line numbers (before, `{"step": 1e400}` stopped the resume with an OverflowError and NaN
  rows were kept)."""
  lines = ROWS.splitlines()
  text = "\n".join(lines[:3] + BAD_LINES + lines[3:]) + "\n"
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(text.encode("latin-1"))
  with caplog.at_level("WARNING"):
    metrics.repair(str(path), first_step=6)
  assert open(path).read() == ROWS
  bad = open(str(path) + ".bad", "rb").read().decode("latin-1").splitlines()
  assert bad == BAD_LINES
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  numbers = ", ".join(str(n) for n in range(4, 4 + len(BAD_LINES)))
  assert warnings == [f"{path}: line(s) {numbers} not a finite-valued JSON row each (cut off by a kill, or edited): "
                      f"set aside in {path}.bad"]
  assert [r["step"] for r in metrics.read_rows(str(path) + ".bad")] == []  # none of them reads as a row
