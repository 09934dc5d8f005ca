"""Environments of tool-integrated RL (issue 43): what answers a model's turn between its turns. The sandbox
(envs/sandbox.py) runs a turn's ```python``` block in a process of its own under limits and returns its output, or
how it failed; the conversation environments (envs/env.py: `SingleTurn`, today's task, and `PythonTool`) start an
episode from a data row, answer each turn with an observation, end it at an answer or a limit and score it."""
