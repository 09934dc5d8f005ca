#!/usr/bin/env bash
# The GPU check on a GPU machine without a package registry (benchmarks/gpu_check.py says what it runs): installs
# the wheels brought in .whl/ or $PACS_WHEELS_DIR (made by `python benchmarks/gpu_wheels.py` where pip reaches a
# registry) into a folder of their own, then runs the check. Arguments go to gpu_check.py (--dry: CPU dry mode).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
wheels="${PACS_WHEELS_DIR:-.whl}"
if compgen -G "$wheels/*.whl" > /dev/null; then
  site="${PACS_WHEELS_SITE:-$(mktemp -d)/site}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    || { echo "gpu_check: installing the wheels in $wheels failed"; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: $(ls "$wheels"/*.whl | wc -l) wheels from $wheels installed in $site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
