"""A run's services around the training loop: the console, metrics files, experiment tracking, the health check,
preemption, teardown, the agreement of processes and the process's runtime (jax.distributed, the compile cache)."""
