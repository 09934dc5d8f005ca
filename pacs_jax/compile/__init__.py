"""Compile analysis: `--compile_only` (ahead-of-time programs for a TPU or GPU target, their memory and HLO cost
with loop trip counts) and `--dry_run` (the per-device memory estimate). The trainer itself is `pacs_jax.trainer`."""
