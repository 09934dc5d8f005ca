"""The laptop study: PACS, GRPO and PPO from one warmed-up tiny base model on a graded task, pass@k before and after
(`python -m pacs_jax.study`, docs/study.md)."""
