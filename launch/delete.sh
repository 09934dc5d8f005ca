#!/usr/bin/env bash
# Deletes a TPU VM, or with --queued the queued resource and its node, without a prompt.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: launch/delete.sh --name NAME --zone ZONE [--queued] [options]

Deletes the TPU VM NAME (gcloud --quiet: no confirmation prompt). Checkpoints under a gs://
workdir are kept; anything on the workers' disks is lost.

Flags:
  --queued     NAME is a queued resource (launch/create.sh --queued): delete it and, with
               --force, its node
$COMMON_FLAGS_HELP
USAGE
}

QUEUED=0

normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  if parse_common_flag "$@"; then shift "$NSHIFT"; continue; fi
  case "$1" in
    --queued) QUEUED=1; shift ;;
    *) die "unknown argument: $1" ;;
  esac
done

require "$NAME" --name
require "$ZONE" --zone

project_flags
if ((QUEUED)); then
  run gcloud compute tpus queued-resources delete "$NAME" --zone "$ZONE" --force --quiet \
    ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
else
  run gcloud compute tpus tpu-vm delete "$NAME" --zone "$ZONE" --quiet ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
fi
