#!/usr/bin/env bash
# Installs pacs-jax on every worker of a TPU VM: code from git or a local tarball, then a Python
# virtualenv with requirements-tpu.txt.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: launch/setup.sh --name NAME --zone ZONE (--repo-url URL [--branch BRANCH] | --scp TARBALL) [options]

On every worker (--worker=all): puts the code in $REMOTE_REPO_DIR, creates the virtualenv
$REMOTE_VENV (Python 3.11+ is required; the TPU images ship 3.10, so uv provides the
interpreter) and runs 'pip install -r requirements-tpu.txt' there. Safe to re-run.

Flags:
  --repo-url URL     git URL to clone (or fetch, if already cloned) on each worker
  --branch BRANCH    branch or tag to check out with --repo-url (default: main)
  --scp TARBALL      copy a local .tar.gz of the repo to each worker instead of using git; the
                     files must sit at the archive root, e.g. made with
                     'git archive --format=tar.gz -o /tmp/pacs-jax.tar.gz HEAD'
  --python VERSION   Python version for the virtualenv (default: 3.12)
$COMMON_FLAGS_HELP

Example:
  launch/setup.sh --name pacs-v5p --zone us-east5-a --repo-url https://github.com/ORG/pacs-jax.git
USAGE
}

REPO_URL=''
BRANCH='main'
TARBALL=''
PYTHON_VERSION='3.12'

normalize_args "$@"
set -- "${ARGS[@]}"
while (($#)); do
  if parse_common_flag "$@"; then shift "$NSHIFT"; continue; fi
  case "$1" in
    --repo-url) need_value "$@"; REPO_URL=$2; shift 2 ;;
    --branch) need_value "$@"; BRANCH=$2; shift 2 ;;
    --scp) need_value "$@"; TARBALL=$2; shift 2 ;;
    --python) need_value "$@"; PYTHON_VERSION=$2; shift 2 ;;
    *) die "unknown argument: $1" ;;
  esac
done

require "$NAME" --name
require "$ZONE" --zone
if [[ -n $REPO_URL && -n $TARBALL ]]; then
  die "give either --repo-url or --scp, not both"
fi
if [[ -z $REPO_URL && -z $TARBALL ]]; then
  die "missing required flag --repo-url URL (or --scp TARBALL)"
fi
# A dry run only previews commands, so the tarball may not have been built yet.
if [[ -n $TARBALL ]] && ((!DRY_RUN)) && [[ ! -f $TARBALL ]]; then
  die "--scp: no such file: $TARBALL"
fi

project_flags
R=$REMOTE_REPO_DIR

if [[ -n $TARBALL ]]; then
  # Extracting over an existing checkout keeps train.log and other run files.
  FETCH_CODE="mkdir -p $R; tar -xzf ~/pacs-jax.tar.gz -C $R"
else
  URL=$(shell_quote "$REPO_URL")
  REF=$(shell_quote "$BRANCH")
  FETCH_CODE="if [ -d $R/.git ]; then git -C $R fetch --depth 1 origin $REF; git -C $R checkout --force -B $REF FETCH_HEAD; else git clone --depth 1 --branch $REF $URL $R; fi"
fi
PY=$(shell_quote "$PYTHON_VERSION")
# `uv` only provides the interpreter; the install itself is plain pip inside the virtualenv.
INSTALL="python3 -m pip install --user --upgrade uv; [ -x $REMOTE_VENV/bin/python ] || ~/.local/bin/uv venv --seed --python $PY $REMOTE_VENV; cd $R; $REMOTE_VENV/bin/pip install -r requirements-tpu.txt"
# Statements joined by `;` under `set -e` (not `&&`, where -e is ignored) so any failure stops the
# worker's setup with a non-zero status.
REMOTE="set -e; $FETCH_CODE; $INSTALL"

if [[ -n $TARBALL ]]; then
  # Destination relative to the remote home, so no `~` needs protecting from the local shell.
  run gcloud compute tpus tpu-vm scp "$TARBALL" "$NAME:pacs-jax.tar.gz" --zone "$ZONE" --worker=all \
    ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
fi
run gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "$REMOTE" \
  ${PROJECT_FLAGS[@]+"${PROJECT_FLAGS[@]}"}
