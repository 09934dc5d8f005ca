"""The CPU default on hosts without accelerators: only when JAX_PLATFORMS is unset and no TPU / GPU device node
exists (the libtpu and CUDA plugin failures a CPU host would print otherwise are checked end to end in
tests/train/test_first_hour.py)."""

import os

from pacs_jax.services import runtime


def test_accelerator_device_nodes(tmp_path):
  assert not runtime.accelerator_present(str(tmp_path))
  for node in ("accel0", "nvidia0", os.path.join("vfio", "0")):
    dev = tmp_path / "hosts" / node.replace(os.sep, "_")
    os.makedirs(os.path.dirname(dev / node), exist_ok=True)
    (dev / node).touch()
    assert runtime.accelerator_present(str(dev)), node
  cpu_host = tmp_path / "cpu_host"
  cpu_host.mkdir()
  (cpu_host / "nvidiactl").touch()  # the control node alone is not a GPU
  assert not runtime.accelerator_present(str(cpu_host))


def test_an_explicit_platform_is_kept(tmp_path):
  assert not runtime.prefer_cpu_without_accelerators({"JAX_PLATFORMS": "tpu"}, str(tmp_path))
