"""Environments of tool-integrated RL (issue 43): what answers a model's turn between its turns. Today the sandbox
(envs/sandbox.py), which runs a turn's ```python``` block in a process of its own under limits and returns its
output, or how it failed, as the next observation; the conversation environments that drive it come next."""
