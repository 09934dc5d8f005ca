#!/usr/bin/env bash
# Starts `python -m pacs_jax.train` in the background on every TPU VM worker, all with the same
# config, so the processes form one multi-host JAX job.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: launch/train.sh --name NAME --zone ZONE --workdir gs://BUCKET/RUN [options] [--config.KEY=VALUE ...] [-- FLAG ...]

Runs, on every worker (--worker=all), in $REMOTE_REPO_DIR with the virtualenv $REMOTE_VENV:
  nohup python -m pacs_jax.train --config CONFIG --workdir WORKDIR [overrides] > $REMOTE_LOG 2>&1 &
and returns at once; follow progress with launch/logs.sh.

Flags:
  --config PATH          config file, relative to the repo (default: configs/qwen3b_v5p.py)
  --workdir DIR          checkpoints and metrics; must be shared by all workers, so a gs:// path
                         (required)
  --config.KEY=VALUE     config overrides, passed through unchanged (e.g. --config.pacs.beta=2.0)
  -- FLAG ...            everything after -- is passed through unchanged too
$COMMON_FLAGS_HELP

Example:
  launch/train.sh --name pacs-v5p --zone us-east5-a --workdir gs://my-bucket/pacs-3b --config.train.steps=300
USAGE
}

CONFIG='configs/qwen3b_v5p.py'
WORKDIR=''
PASSTHROUGH=()

normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  if parse_common_flag "$@"; then shift "$NSHIFT"; continue; fi
  case "$1" in
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
    --config.*=*) PASSTHROUGH+=("$1"); shift ;;
    # `--config.key value` would need to know which overrides take a value; one form is clearer.
    --config.*) die "write config overrides as --config.KEY=VALUE (got '$1')" ;;
    --) shift; PASSTHROUGH+=("$@"); break ;;
    *) die "unknown argument: $1" ;;
  esac
done

require "$NAME" --name
require "$ZONE" --zone
require "$WORKDIR" --workdir
if [[ $WORKDIR != gs://* ]]; then
  printf '%s: warning: --workdir %s is not a gs:// path; each worker will write its own copy\n' \
    "$(basename "$0")" "$WORKDIR" >&2
fi

project_flags
TRAIN_ARGS=$(quote_words python -m pacs_jax.train --config "$CONFIG" --workdir "$WORKDIR" \
  ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"})
# The braces background only the trainer, with every stream redirected, so the ssh session
# closes right away instead of waiting on the job; nohup keeps it alive after the hang-up.
REMOTE="cd $REMOTE_REPO_DIR && . $REMOTE_VENV/bin/activate && { nohup $TRAIN_ARGS > $REMOTE_LOG 2>&1 < /dev/null & }"

run gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "$REMOTE" \
  ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
