"""launch/*.sh: the exact gcloud commands under --dry-run, their quoting, and the remote commands run
on a fake worker (a temporary HOME). gcloud itself is never needed: a recording stub stands in."""

import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = ["create", "setup", "train", "logs", "delete"]
TRICKY_WORDS = ["plain", "", "two words", "it's", 'say "hi"', "$HOME", "`id`", "a;b&&c|d", "~/x", "back\\slash",
                "new\nline", "*", "--config.x=y z", "gs://bucket/run-1", "tab\there", "!bang"]


@pytest.fixture
def fake_gcloud(tmp_path):
  """A `gcloud` first on PATH that records each call's argv (one JSON list per line) and succeeds."""
  bin_dir = tmp_path / "fake_bin"
  bin_dir.mkdir()
  log = tmp_path / "gcloud_calls.jsonl"
  script = bin_dir / "gcloud"
  script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"with open({str(log)!r}, 'a') as f:\n  f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
  script.chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

  def calls():
    if not log.exists():
      return []
    return [["gcloud"] + json.loads(line) for line in log.read_text().splitlines()]

  return env, calls


def launch(fake_gcloud, script, *args, cwd=None):
  env, _ = fake_gcloud
  return subprocess.run(["bash", str(LAUNCH / f"{script}.sh"), *args], capture_output=True, text=True, env=env,
                        cwd=cwd or REPO, timeout=60)


def dry_run(fake_gcloud, script, *args):
  """Runs a script with --dry-run; returns its printed commands, each split back into argv."""
  result = launch(fake_gcloud, script, "--dry-run", *args)  # first: after `--` it would be passed through
  assert result.returncode == 0, result.stderr
  _, calls = fake_gcloud
  assert calls() == [], "--dry-run must not call gcloud"
  lines = result.stdout.splitlines()
  assert lines and all(line.startswith("gcloud ") for line in lines), result.stdout
  return [shlex.split(line) for line in lines]


def remote_command(argv):
  assert argv.count("--command") == 1
  return argv[argv.index("--command") + 1]


# ---------------------------------------------------------------------------------------------- create


def test_create_tpu_vm(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "create", "--name", "pacs-v5p", "--zone", "us-east5-a", "--accelerator-type", "v5p-64")
  assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pacs-v5p", "--zone", "us-east5-a",
                  "--accelerator-type", "v5p-64", "--version", "v2-alpha-tpuv5"]


def test_create_spot_with_project_and_equals_form(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "create", "--name=pacs-v5p", "--zone=us-east5-a", "--accelerator-type=v5p-128",
                    "--runtime-version=v2-alpha-tpuv5", "--spot", "--project=my-project")
  assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pacs-v5p", "--zone", "us-east5-a",
                  "--accelerator-type", "v5p-128", "--version", "v2-alpha-tpuv5", "--spot", "--project", "my-project"]


def test_create_queued_resource(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "create", "--name", "pacs-qr", "--zone", "us-east5-a", "--accelerator-type", "v5p-64",
                    "--queued", "--spot")
  assert argv == ["gcloud", "compute", "tpus", "queued-resources", "create", "pacs-qr", "--node-id", "pacs-qr",
                  "--zone", "us-east5-a", "--accelerator-type", "v5p-64", "--runtime-version", "v2-alpha-tpuv5",
                  "--spot"]


def test_create_without_spot_has_no_spot_flag(fake_gcloud):
  for extra in [(), ("--queued",)]:
    (argv,) = dry_run(fake_gcloud, "create", "--name", "n", "--zone", "z", "--accelerator-type", "v5p-8", *extra)
    assert "--spot" not in argv


@pytest.mark.parametrize("accelerator, runtime", [("v5p-8", "v2-alpha-tpuv5"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
                                                  ("v6e-8", "v2-alpha-tpuv6e"), ("v4-32", "tpu-ubuntu2204-base")])
def test_create_default_runtime_per_generation(fake_gcloud, accelerator, runtime):
  (argv,) = dry_run(fake_gcloud, "create", "--name", "n", "--zone", "z", "--accelerator-type", accelerator)
  assert argv[argv.index("--version") + 1] == runtime
  (argv,) = dry_run(fake_gcloud, "create", "--name", "n", "--zone", "z", "--accelerator-type", accelerator,
                    "--runtime-version", "custom-rt")
  assert argv[argv.index("--version") + 1] == "custom-rt"


def test_create_unknown_generation_needs_runtime_version(fake_gcloud):
  result = launch(fake_gcloud, "create", "--name", "n", "--zone", "z", "--accelerator-type", "v9x-8", "--dry-run")
  assert result.returncode != 0
  assert "--runtime-version" in result.stderr


# ----------------------------------------------------------------------------------------------- setup


def test_setup_from_git(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "setup", "--name", "pacs-v5p", "--zone", "us-east5-a",
                    "--repo-url", "https://github.com/org/pacs-jax.git", "--branch", "dev")
  assert argv[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pacs-v5p", "--zone", "us-east5-a",
                       "--worker=all", "--command"]
  remote = remote_command(argv)
  assert "git clone --depth 1 --branch dev https://github.com/org/pacs-jax.git ~/pacs-jax" in remote
  assert "pip install -r requirements-tpu.txt" in remote
  assert subprocess.run(["bash", "-n", "-c", remote]).returncode == 0


def test_setup_from_tarball(fake_gcloud, tmp_path):
  scp, ssh = dry_run(fake_gcloud, "setup", "--name", "pacs-v5p", "--zone", "us-east5-a", "--scp", "/tmp/my code/p.tar.gz",
                     "--project", "proj")
  assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "/tmp/my code/p.tar.gz", "pacs-v5p:pacs-jax.tar.gz",
                 "--zone", "us-east5-a", "--worker=all", "--project", "proj"]
  assert ssh[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pacs-v5p", "--zone", "us-east5-a", "--worker=all",
                      "--command"]
  assert ssh[-2:] == ["--project", "proj"]
  assert "tar -xzf ~/pacs-jax.tar.gz -C ~/pacs-jax" in remote_command(ssh)


def test_setup_needs_exactly_one_code_source(fake_gcloud):
  result = launch(fake_gcloud, "setup", "--name", "n", "--zone", "z", "--dry-run")
  assert result.returncode != 0 and "--repo-url" in result.stderr
  result = launch(fake_gcloud, "setup", "--name", "n", "--zone", "z", "--repo-url", "u", "--scp", "t.tgz", "--dry-run")
  assert result.returncode != 0 and "not both" in result.stderr


def fake_worker(tmp_path):
  """A HOME and PATH where python3, uv and the virtualenv's pip only record what they were asked."""
  home = tmp_path / "home"
  bin_dir = tmp_path / "worker_bin"
  venv_bin = home / "pacs-venv" / "bin"
  for d in (home / ".local" / "bin", bin_dir, venv_bin):
    d.mkdir(parents=True)
  calls = tmp_path / "worker_calls.txt"
  record = f'echo "$(basename "$0") [$PWD] $*" >> {shlex.quote(str(calls))}\n'
  # uv "creates" the virtualenv by adding its python, so a re-run must skip creating it.
  make_python = f'touch {venv_bin}/python; chmod +x {venv_bin}/python\n'
  stubs = {bin_dir / "python3": record, home / ".local" / "bin" / "uv": record + make_python, venv_bin / "pip": record}
  for path, body in stubs.items():
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
  env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1"}
  return home, env, calls


def on_worker(remote, env, timeout=60):
  """Runs a --command string the way gcloud's ssh does: a shell started in the worker's HOME."""
  return subprocess.run(["bash", "-c", remote], env=env, cwd=env["HOME"], capture_output=True, text=True,
                        timeout=timeout)


def test_setup_remote_command_installs_from_tarball_on_a_fake_worker(fake_gcloud, tmp_path):
  home, env, calls = fake_worker(tmp_path)
  src = tmp_path / "src"
  src.mkdir()
  (src / "requirements-tpu.txt").write_text("-e .\n")
  with tarfile.open(home / "pacs-jax.tar.gz", "w:gz") as tar:  # what the scp step puts there
    tar.add(src / "requirements-tpu.txt", arcname="requirements-tpu.txt")
  _, ssh = dry_run(fake_gcloud, "setup", "--name", "n", "--zone", "z", "--scp", "p.tar.gz")
  for _ in range(2):  # re-running setup must work too
    result = on_worker(remote_command(ssh), env)
    assert result.returncode == 0, result.stderr
  assert (home / "pacs-jax" / "requirements-tpu.txt").read_text() == "-e .\n"
  lines = calls.read_text().splitlines()
  repo = home / "pacs-jax"
  assert lines == [
      f"python3 [{home}] -m pip install --user --upgrade uv",
      f"uv [{home}] venv --seed --python 3.12 {home}/pacs-venv",
      f"pip [{repo}] install -r requirements-tpu.txt",
      f"python3 [{home}] -m pip install --user --upgrade uv",
      f"pip [{repo}] install -r requirements-tpu.txt",
  ]


def test_setup_remote_command_clones_then_updates_from_git_on_a_fake_worker(fake_gcloud, tmp_path):
  home, env, calls = fake_worker(tmp_path)
  origin = tmp_path / "origin"
  git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
  subprocess.run(git + ["init", "-q", str(origin)], check=True, env=env)
  (origin / "requirements-tpu.txt").write_text("v1\n")
  subprocess.run(git + ["-C", str(origin), "add", "."], check=True, env=env)
  subprocess.run(git + ["-C", str(origin), "commit", "-qm", "v1"], check=True, env=env)
  (argv,) = dry_run(fake_gcloud, "setup", "--name", "n", "--zone", "z", "--repo-url", f"file://{origin}")
  run_remote = lambda: on_worker(remote_command(argv), env)
  result = run_remote()
  assert result.returncode == 0, result.stderr
  assert (home / "pacs-jax" / "requirements-tpu.txt").read_text() == "v1\n"
  (origin / "requirements-tpu.txt").write_text("v2\n")
  subprocess.run(git + ["-C", str(origin), "commit", "-qam", "v2"], check=True, env=env)
  result = run_remote()
  assert result.returncode == 0, result.stderr
  assert (home / "pacs-jax" / "requirements-tpu.txt").read_text() == "v2\n"
  assert calls.read_text().count("install -r requirements-tpu.txt") == 2


# ----------------------------------------------------------------------------------------------- train

OVERRIDES = ["--config.pacs.beta=2.0", "--config.run_name=my run", "--config.note=it's $HOME; `id`"]


def test_train_command(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "train", "--name", "pacs-v5p", "--zone", "us-east5-a", "--workdir", "gs://bucket/pacs-3b",
                    *OVERRIDES, "--project", "proj")
  assert argv[:10] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pacs-v5p", "--zone", "us-east5-a",
                       "--worker=all", "--command"]
  assert argv[-2:] == ["--project", "proj"]
  remote = remote_command(argv)
  assert remote.startswith("cd ~/pacs-jax && ")
  assert ("nohup python -m pacs_jax.train --config configs/qwen3b_v5p.py --workdir gs://bucket/pacs-3b "
          "--config.pacs.beta=2.0 '--config.run_name=my run' ") in remote
  assert "> train.log 2>&1" in remote
  assert subprocess.run(["bash", "-n", "-c", remote]).returncode == 0


def test_train_config_path_and_passthrough_after_double_dash(fake_gcloud):
  # `--dry-run` after `--` belongs to the trainer, not to train.sh.
  (argv,) = dry_run(fake_gcloud, "train", "--name", "n", "--zone", "z", "--workdir", "gs://b/r", "--config",
                    "configs/qwen7b_v5p.py", "--", "--jax_debug_nans", "--dry-run")
  assert ("python -m pacs_jax.train --config configs/qwen7b_v5p.py --workdir gs://b/r --jax_debug_nans --dry-run"
          in remote_command(argv))


def test_train_override_needs_equals_form(fake_gcloud):
  result = launch(fake_gcloud, "train", "--name", "n", "--zone", "z", "--workdir", "gs://b/r", "--config.pacs.beta",
                  "2.0", "--dry-run")
  assert result.returncode != 0 and "--config.KEY=VALUE" in result.stderr


def test_train_remote_command_passes_exact_argv_and_detaches(fake_gcloud, tmp_path):
  """Runs the remote command in a fake worker HOME: the trainer gets exactly the argv given, and the
  command returns while the trainer still runs (so `gcloud ssh` does not wait for training)."""
  home = tmp_path / "home"
  venv_bin = home / "pacs-venv" / "bin"
  venv_bin.mkdir(parents=True)
  (home / "pacs-jax").mkdir()
  argv_file, pid_file = tmp_path / "argv.json", tmp_path / "pid"
  fake_python = venv_bin / "python"
  fake_python.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                         f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                         f"json.dump([os.getcwd()] + sys.argv[1:], open({str(argv_file)!r}, 'w'))\n"
                         "print('training...', flush=True)\ntime.sleep(30)\n")
  fake_python.chmod(0o755)
  (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
  (argv,) = dry_run(fake_gcloud, "train", "--name", "n", "--zone", "z", "--workdir", "gs://b/r", *OVERRIDES)
  env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
  # capture_output: if the background trainer kept the pipes open, this would block until the timeout.
  result = on_worker(remote_command(argv), env, timeout=20)
  assert result.returncode == 0, result.stderr
  try:
    deadline = time.monotonic() + 20
    while not argv_file.exists() or not argv_file.read_text().endswith("]"):
      assert time.monotonic() < deadline, "the trainer never started"
      time.sleep(0.05)
    assert json.loads(argv_file.read_text()) == [str(home / "pacs-jax"), "-m", "pacs_jax.train", "--config",
                                                 "configs/qwen3b_v5p.py", "--workdir", "gs://b/r", *OVERRIDES]
    while "training..." not in (home / "pacs-jax" / "train.log").read_text():
      assert time.monotonic() < deadline, "the trainer's output never reached train.log"
      time.sleep(0.05)
  finally:
    while not pid_file.exists() or not pid_file.read_text():
      time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)


# -------------------------------------------------------------------------------------- logs and delete


def test_logs(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "logs", "--name", "pacs-v5p", "--zone", "us-east5-a")
  assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pacs-v5p", "--zone", "us-east5-a", "--worker=0",
                  "--command", "tail -n 100 -F ~/pacs-jax/train.log"]
  (argv,) = dry_run(fake_gcloud, "logs", "--name", "n", "--zone", "z", "--worker", "3", "--lines", "5")
  assert "--worker=3" in argv and remote_command(argv) == "tail -n 5 -F ~/pacs-jax/train.log"


def test_delete(fake_gcloud):
  (argv,) = dry_run(fake_gcloud, "delete", "--name", "pacs-v5p", "--zone", "us-east5-a", "--project", "proj")
  assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pacs-v5p", "--zone", "us-east5-a", "--quiet",
                  "--project", "proj"]
  (argv,) = dry_run(fake_gcloud, "delete", "--name", "pacs-qr", "--zone", "us-east5-a", "--queued")
  assert argv == ["gcloud", "compute", "tpus", "queued-resources", "delete", "pacs-qr", "--zone", "us-east5-a",
                  "--force", "--quiet"]


# ------------------------------------------------------------------------------ shared behaviour, quoting

REQUIRED = {
    "create": ["--name", "n", "--zone", "z", "--accelerator-type", "v5p-64"],
    "setup": ["--name", "n", "--zone", "z", "--repo-url", "u"],
    "train": ["--name", "n", "--zone", "z", "--workdir", "gs://b/r"],
    "logs": ["--name", "n", "--zone", "z"],
    "delete": ["--name", "n", "--zone", "z"],
}


@pytest.mark.parametrize("script, flag", [(s, args[i]) for s, args in REQUIRED.items() for i in range(0, len(args), 2)])
def test_missing_required_flag_fails_clearly(fake_gcloud, script, flag):
  args = REQUIRED[script]
  i = args.index(flag)
  result = launch(fake_gcloud, script, *args[:i], *args[i + 2:], "--dry-run")
  assert result.returncode != 0
  assert result.stdout == ""
  assert f"missing required flag {flag}" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_flag_without_value_and_unknown_flag_fail(fake_gcloud, script):
  result = launch(fake_gcloud, script, "--name", "--zone", "z", "--dry-run")
  assert result.returncode != 0 and "--name needs a value" in result.stderr
  result = launch(fake_gcloud, script, *REQUIRED[script], "--bogus", "--dry-run")
  assert result.returncode != 0 and "unknown argument: --bogus" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(fake_gcloud, script):
  result = launch(fake_gcloud, script, "--help")
  assert result.returncode == 0
  assert result.stdout.startswith(f"Usage: launch/{script}.sh")
  assert "--dry-run" in result.stdout
  assert os.access(LAUNCH / f"{script}.sh", os.X_OK)


@pytest.mark.parametrize("script", SCRIPTS)
def test_dry_run_prints_what_a_real_run_executes(fake_gcloud, tmp_path, script):
  """Without --dry-run the same argv reaches gcloud, so a printed line is exactly what would run."""
  args = list(REQUIRED[script])
  if script == "train":
    args += OVERRIDES
  if script == "setup":
    tarball = tmp_path / "code dir" / "p.tar.gz"
    tarball.parent.mkdir()
    tarball.write_bytes(b"")
    args = ["--name", "n", "--zone", "z", "--scp", str(tarball)]
  printed = dry_run(fake_gcloud, script, *args)
  result = launch(fake_gcloud, script, *args, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  _, calls = fake_gcloud
  assert calls() == printed


def test_quote_words_round_trips_through_bash_and_shlex():
  script = f'source {shlex.quote(str(LAUNCH / "common.sh"))}; line=$(quote_words "$@"); printf "%s" "$line"'
  line = subprocess.run(["bash", "-c", script, "_", *TRICKY_WORDS], capture_output=True, text=True, check=True).stdout
  assert shlex.split(line) == TRICKY_WORDS
  # And bash itself reads the line back into the same words.
  out = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True, check=True).stdout
  assert out.split("\0")[:-1] == TRICKY_WORDS
