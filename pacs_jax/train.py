"""`python -m pacs_jax.train`: trains Qwen2 with PACS / GRPO / PPO (the trainer lands with issue 6)."""

import sys


def main() -> int:
  print("pacs_jax.train: not implemented yet (the trainer lands with issue 6)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
