"""The laptop study: PACS, GRPO and PPO from one warmed-up tiny base model on a graded task, pass@k before and after
(`python -m pacs_jax.study`, docs/study.md); and the tool that plots runs side by side (`compare_runs.py`, behind
`python -m pacs_jax.compare`)."""
