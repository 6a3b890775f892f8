#!/usr/bin/env bash
# The README's test command: set up (once), then run the whole suite. With no arguments:
# the unit tier on both cores (pytest-xdist, each file whole on one worker so its module
# fixtures are built once), then the integration and end-to-end tiers one test at a time
# (real Ray / DeepSpeed / MLflow, which use both cores themselves); the exit status is
# the first failing tier's. Arguments go to one plain pytest run instead (e.g. -m "not
# integration and not e2e" for the unit tier only, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
# --durations: the slowest tests, printed at the end of every run (CI time is a budget).
run() { .venv/bin/python -m pytest -q -rs --durations=15 "$@"; }
if [ $# -gt 0 ]; then
  run "$@"
  exit
fi
status=0
run -n 2 --dist loadfile -m "not integration and not e2e" || status=$?
run -m "integration or e2e" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit $status
