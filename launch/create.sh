#!/usr/bin/env bash
# Creates a Cloud TPU VM (or a queued resource that becomes one) for pacs-jax training.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: launch/create.sh --name NAME --zone ZONE --accelerator-type TYPE [options]

Creates a TPU VM directly, or with --queued a queued resource whose node gets the same name
(wait until 'gcloud compute tpus queued-resources describe NAME --zone ZONE' shows ACTIVE).

Flags:
  --accelerator-type TYPE    e.g. v5p-64 (required)
  --runtime-version VERSION  TPU software version; default from TYPE: v5p -> v2-alpha-tpuv5,
                             v5litepod -> v2-alpha-tpuv5-lite, v6e -> v2-alpha-tpuv6e,
                             v2/v3/v4 -> tpu-ubuntu2204-base
  --spot                     Spot capacity (cheaper, can be preempted)
  --queued                   create a queued resource instead of the VM directly
$COMMON_FLAGS_HELP

Example:
  launch/create.sh --name pacs-v5p --zone us-east5-a --accelerator-type v5p-64 --queued --spot
USAGE
}

# The runtime that Google documents for running JAX on each TPU generation.
default_runtime_version() {
  case "$1" in
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    *) die "no default runtime version for accelerator type '$1'; pass --runtime-version" ;;
  esac
}

ACCELERATOR_TYPE=''
RUNTIME_VERSION=''
SPOT=0
QUEUED=0

normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  if parse_common_flag "$@"; then shift "$NSHIFT"; continue; fi
  case "$1" in
    --accelerator-type) need_value "$@"; ACCELERATOR_TYPE=$2; shift 2 ;;
    --runtime-version) need_value "$@"; RUNTIME_VERSION=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --queued) QUEUED=1; shift ;;
    *) die "unknown argument: $1" ;;
  esac
done

require "$NAME" --name
require "$ZONE" --zone
require "$ACCELERATOR_TYPE" --accelerator-type
if [[ -z $RUNTIME_VERSION ]]; then
  RUNTIME_VERSION=$(default_runtime_version "$ACCELERATOR_TYPE")
fi

EXTRA=()
if ((SPOT)); then EXTRA+=(--spot); fi
project_flags
EXTRA+=(${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"})

# The two commands name the runtime flag differently (--version vs --runtime-version).
if ((QUEUED)); then
  run gcloud compute tpus queued-resources create "$NAME" --node-id "$NAME" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR_TYPE" --runtime-version "$RUNTIME_VERSION" ${EXTRA[@]+"${EXTRA[@]}"}
else
  run gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" ${EXTRA[@]+"${EXTRA[@]}"}
fi
