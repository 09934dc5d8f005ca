#!/usr/bin/env bash
# Streams the training log of one TPU VM worker (worker 0 by default, which writes the metrics).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: launch/logs.sh --name NAME --zone ZONE [--worker N] [--lines N] [options]

Follows $REMOTE_REPO_DIR/$REMOTE_LOG on one worker (tail -F; Ctrl-C stops following, not training).

Flags:
  --worker N     which worker's log (default: 0, the one that writes logs and metrics)
  --lines N      lines of history to show first (default: 100)
$COMMON_FLAGS_HELP
USAGE
}

WORKER='0'
LINES='100'

normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  if parse_common_flag "$@"; then shift "$NSHIFT"; continue; fi
  case "$1" in
    --worker) need_value "$@"; WORKER=$2; shift 2 ;;
    --lines) need_value "$@"; LINES=$2; shift 2 ;;
    *) die "unknown argument: $1" ;;
  esac
done

require "$NAME" --name
require "$ZONE" --zone
[[ $WORKER =~ ^[0-9]+$ ]] || die "--worker must be a worker number, got '$WORKER'"
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'"

project_flags
# -F (not -f) keeps following when the log is recreated by a restarted run.
run gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker="$WORKER" \
  --command "tail -n $LINES -F $REMOTE_REPO_DIR/$REMOTE_LOG" ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
