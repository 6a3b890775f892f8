#!/usr/bin/env bash
# The README's test command: set up (once), then run the whole suite (unit, then
# integration with real Ray / DeepSpeed / MLflow on CPU, then end to end).
# Extra arguments go to pytest (e.g. -m "not integration and not e2e" for unit only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
# --durations: the slowest tests, printed at the end of every run (CI time is a budget).
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
