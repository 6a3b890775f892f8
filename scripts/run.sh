#!/usr/bin/env bash
# The README's main command: set up (once), then run the pipeline on the embedded
# default. Extra arguments go to `python -m jobs.pipeline` (e.g. --dry-run, key=value).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec .venv/bin/python -m jobs.pipeline --config configs/experiments/smollm2.yaml "$@"
