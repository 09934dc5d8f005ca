"""The trainer: `pacs_jax.train(cfg, workdir)` trains until `cfg.steps` (resuming from the workdir's newest
checkpoint) and returns the last step's metrics; `pacs_jax.Trainer(cfg, workdir)` gives the steps one by one.

This package is also the `python -m pacs_jax.train` command line. Being callable, it is the public `train`
itself: `from pacs_jax import train` cannot give anything else once a module of the package is imported (the
import system binds the package to the name `train` of `pacs_jax`).
"""

import sys as _sys
import types as _types


class _Trainer(_types.ModuleType):

  def __call__(self, cfg, workdir: str, devices=None) -> dict:
    """Trains until `cfg.steps` (resuming from `workdir`'s newest checkpoint); returns the last step's metrics.
    `devices`: the mesh's devices (default: all of them)."""
    from pacs_jax.train import loop
    return loop.train(cfg, workdir, devices)


_sys.modules[__name__].__class__ = _Trainer
