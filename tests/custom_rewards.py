"""Rewards the tests name in a config (`reward.fn = "custom_rewards:always_one"`): plain module-level functions in a
module of tests/ (on the path of pytest and of the reward worker processes it starts) that imports nothing heavy,
so a worker unpickles one in milliseconds."""

NOT_A_FUNCTION = 3


def always_one(data_source: str, response: str, answer: str) -> float:
  """A reward that returns a score alone: every response earns 1.0."""
  return 1.0


def exact_or_why(data_source: str, response: str, answer: str):
  """Either form: (0.0, why) for an empty response, a plain score otherwise (1.0 when the response is the answer);
  raises on "raise"."""
  if not response:
    return 0.0, "empty response"
  if response == "raise":
    raise ValueError("asked to")
  return float(response == answer)
