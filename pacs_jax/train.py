"""`python -m pacs_jax.train --config configs/<name>.py [--workdir DIR] [--config.field=value ...]`: the trainer's
command line (the trainer is pacs_jax/trainer/). Run it; importing it as `pacs_jax.train` would bind this module
over the public function `pacs_jax.train`.

Without flags it trains a tiny random Qwen2 on the built-in synthetic task on CPU (configs/tiny_cpu.py).
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from pacs_jax import errors

if __name__ == "__main__":  # (before the config file is read below: its imports take seconds)
  errors.stop_on_ctrl_c("train")

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                               "tiny_cpu.py")

_CONFIG = errors.define_config_file("train", "config", _DEFAULT_CONFIG, "Training config file (a get_config() module).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and logs go (default: runs/<config name>-<algorithm>).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build everything abstractly on a mesh of config.hardware.num_devices "
                             "devices and print an estimate of per-device memory; train nothing.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Compile every program of the run ahead of time for the "
                                  "config's target (hardware.tpu_topology: needs libtpu; hardware.gpu_target: needs "
                                  "jax's CUDA plugin, no GPU) from abstract weights and print per-chip memory, cost and a fits verdict; exit 1 if it does not fit. Loads nothing.")


def main(argv):
  errors.no_arguments_quiet_logs(argv)
  cfg = errors.config_value(_CONFIG)
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  if _COMPILE_ONLY.value:
    from pacs_jax.compile import aot_split
    sys.exit(aot_split.main(cfg, config_path))  # aot.main's, or the split devices' (rollout.devices)
  if _DRY_RUN.value:
    from pacs_jax.compile import memory
    print(memory.dry_run(cfg))
    return
  from pacs_jax.storage import workdir as workdir_lib
  workdir = _WORKDIR.value or workdir_lib.default_workdir(config_path, cfg.algorithm)
  errors.log_to(workdir)  # a failure's traceback goes to WORKDIR/errors.log once the workdir exists
  from pacs_jax.services import runtime
  runtime.prefer_cpu_without_accelerators()
  runtime.init(cfg)
  import jax
  from pacs_jax.services import collapse, console
  from pacs_jax.trainer import loop
  # An expected failure (config, data, lock, checkpoint, storage) ends in one line (pacs_jax.errors).
  trainer = loop.Trainer(cfg, workdir)
  primary = jax.process_index() == 0
  if primary:
    name = os.path.relpath(config_path)
    print(trainer.banner(name if not name.startswith("..") else config_path), flush=True)
  trainer.run()
  if primary:
    closing = console.closing_line(trainer.workdir, int(trainer.state.step))
    print(collapse.closing(closing, trainer.collapses.events), flush=True)  # says so when the run collapsed


if __name__ == "__main__":
  errors.run("train", main)
