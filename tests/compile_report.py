"""Checks shared by the `--compile_only` tests (TPU and GPU targets): every program of the run compiled, with
figures that hold together whatever the backend."""

PROGRAMS = ("to_sample_params", "init_decode_state", "prefill[B=8,T=16]", "prefill[B=8,T=32]", "insert[",
            "decode[pages=", "logprobs", "train_step")


def by_name(report, prefix):
  found = [p for p in report.programs if p.name.startswith(prefix)]
  assert found, [p.name for p in report.programs]
  return found


def assert_every_program_compiled(report):
  """No failure, every kind of program present (the train step last), and memory figures that are positive
  and consistent (the peak holds the arguments and what the outputs add), bytes accessed counted."""
  assert not report.failed, [(p.name, p.error) for p in report.failed]
  for prefix in PROGRAMS:
    by_name(report, prefix)
  assert report.programs[-1].name == "train_step"
  for p in report.programs:
    assert p.compile_s > 0 and p.output > 0 and p.temp >= 0, p
    assert p.argument > 0 or p.name == "init_decode_state", p  # it takes no arguments: it allocates the cache
    assert p.peak >= p.argument and p.peak >= p.output - p.alias, p
    assert p.bytes_accessed > 0, p
