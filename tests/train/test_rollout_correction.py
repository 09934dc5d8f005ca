"""The rollout correction in the trainer (issue 33): GRPO with rollout.tis_imp_ratio_cap trains on the tiny config,
the engine's behaviour log-probs line up with the trainer's π_old (importance weights ≈ 1 on the synchronous path),
and the importance and staleness metrics reach metrics.jsonl and TensorBoard."""

import jax
import numpy as np

from pacs_jax.trainer import loop
from tests.train.test_train_e2e import rows, tensorboard_tags, tiny

CORRECTION_METRICS = ("rollout_corr/is_weight_mean", "rollout_corr/is_weight_max", "rollout_corr/tis_truncated_frac",
                      "rollout/staleness_mean", "rollout/staleness_max", "rollout/staleness_frac/0")


def test_grpo_with_tis_logs_importance_and_staleness(tmp_path):
  cfg = tiny(steps=2, eval_every=0, algorithm="grpo", **{"rollout.tis_imp_ratio_cap": 2.0})
  loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  logged = rows(tmp_path)
  assert [r["step"] for r in logged] == [1, 2]
  for row in logged:
    for name in CORRECTION_METRICS:
      assert name in row, name
    assert np.isfinite(row["loss"])
    # Synchronous: every response by the policy the update starts from, and the engine's log-probs are the
    # trainer's up to float rounding (fp32), so π_old / μ ≈ 1 and nothing is truncated.
    assert row["rollout/staleness_max"] == 0 and row["rollout/staleness_frac/0"] == 1.0
    assert abs(row["rollout_corr/is_weight_mean"] - 1.0) < 1e-3, row["rollout_corr/is_weight_mean"]
    assert row["rollout_corr/is_weight_max"] < 1.05 and row["rollout_corr/tis_truncated_frac"] == 0.0
  tags = tensorboard_tags(tmp_path)
  for name in CORRECTION_METRICS:
    assert name in tags, name
