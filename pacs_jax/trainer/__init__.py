"""The trainer: `loop.Trainer(cfg, workdir)` builds a run and `run()` trains it; `loop.train(cfg, workdir)` is the
public `pacs_jax.train`. A step's stages are in stages.py; the command line is pacs_jax/train.py."""
