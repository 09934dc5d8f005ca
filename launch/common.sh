# shellcheck shell=bash disable=SC2034  # the variables set here are read by the sourcing scripts
# Shared by launch/*.sh: flag parsing helpers, exact shell quoting, and `run`, which prints
# commands instead of running them under --dry-run. Source it; don't execute it.

# Where the repo and its virtualenv live on every TPU VM worker. The quotes keep `~` for the remote
# shell to expand (the local home is not the worker's).
# shellcheck disable=SC2088
REMOTE_REPO_DIR='~/pacs-jax'
REMOTE_VENV='~/pacs-venv'
REMOTE_LOG='train.log'  # relative to REMOTE_REPO_DIR

DRY_RUN=0
NAME=''
ZONE=''
PROJECT=''

die() {
  printf '%s: error: %s\n' "$(basename "$0")" "$*" >&2
  printf "Run '%s --help' for usage.\n" "$0" >&2
  exit 2
}

# shell_quote WORD: prints WORD so that bash reads it back as exactly one word, unchanged.
# Plain words stay bare (readable output); anything else is single-quoted, ' written as '\''.
shell_quote() {
  local word=$1 escaped="'\\''"
  if [[ $word =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$word"
  else
    printf "'%s'" "${word//\'/$escaped}"
  fi
}

# quote_words WORD...: the words as one copy-pasteable command line (no trailing newline).
quote_words() {
  local word sep=''
  for word in "$@"; do
    printf '%s' "$sep"
    shell_quote "$word"
    sep=' '
  done
}

# run CMD ARG...: under --dry-run print the command (one line, exactly quoted) and return;
# otherwise echo it to stderr and execute it. gcloud is only needed for real runs.
run() {
  if ((DRY_RUN)); then
    quote_words "$@"
    printf '\n'
    return 0
  fi
  command -v "$1" >/dev/null 2>&1 || die "'$1' not found on PATH (install the Google Cloud SDK, or use --dry-run)"
  printf '+ %s\n' "$(quote_words "$@")" >&2
  "$@"
}

# normalize_args ARG...: sets ARGS with every `--flag=value` split into `--flag value`, so the
# per-script parsers handle one form. `--config.key=value` overrides (a dot in the name) and
# everything after `--` are left untouched for train.sh to pass through.
normalize_args() {
  ARGS=()
  local arg rest=0
  for arg in "$@"; do
    if ((rest)); then
      ARGS+=("$arg")
    elif [[ $arg == -- ]]; then
      ARGS+=("$arg")
      rest=1
    elif [[ $arg =~ ^(--[a-z][a-z0-9-]*)=(.*)$ ]]; then
      ARGS+=("${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}")
    else
      ARGS+=("$arg")
    fi
  done
}

# need_value FLAG [VALUE...]: fails unless FLAG is followed by a value (not another flag).
need_value() {
  if (($# < 2)) || [[ -z $2 || $2 == --* ]]; then
    die "$1 needs a value"
  fi
}

# parse_common_flag ARG...: handles the flags every script shares; sets NSHIFT to the number of
# words consumed and returns 0, or returns 1 when $1 is not a common flag.
parse_common_flag() {
  case "$1" in
    --name) need_value "$@"; NAME=$2; NSHIFT=2 ;;
    --zone) need_value "$@"; ZONE=$2; NSHIFT=2 ;;
    --project) need_value "$@"; PROJECT=$2; NSHIFT=2 ;;
    --dry-run) DRY_RUN=1; NSHIFT=1 ;;
    -h | --help) usage; exit 0 ;;
    *) return 1 ;;
  esac
}

# require VALUE FLAG: fails with a clear message when a required flag was not given.
require() {
  [[ -n $1 ]] || die "missing required flag $2"
}

# project_flags: the optional `--project P` words, for appending to gcloud commands.
project_flags() {
  PROJECT_FLAGS=()
  if [[ -n $PROJECT ]]; then
    PROJECT_FLAGS=(--project "$PROJECT")
  fi
}

COMMON_FLAGS_HELP='Common flags:
  --name NAME          TPU VM (node) name; also the queued-resource id with --queued (required)
  --zone ZONE          e.g. us-east5-a for v5p (required)
  --project PROJECT    GCP project (default: gcloud config core/project)
  --dry-run            print the exact gcloud commands, one per line, and exit 0 (no gcloud needed)
  -h, --help           show this help
Flags accept both "--flag value" and "--flag=value".'
