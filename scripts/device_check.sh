#!/usr/bin/env bash
# The torch-only device check (issue 32): on a GPU box that has Python with torch (plus
# numpy and PyYAML) and nothing else -- no transformers, Ray, DeepSpeed or MLflow, no
# network -- one command measures DLite at Qwen3-4B's shape with random weights within
# an 8-minute budget (not yet run on a GPU): target decode / verify steps and both
# drafters' rounds at 1K / 8K / 32K context, greedy losslessness through DLite's
# decoding loop, the loss's peak memory and the training loop's samples/s at the
# production batch.
# It writes one JSON; dlite/bench/device.py says what is in it. Without CUDA it runs at
# a smoke size on CPU in seconds (tests/unit/test_device_check.py, CI).
#
#   bash scripts/device_check.sh [--out FILE] [--smoke] [--layers N] [--device cuda|cpu]
#
# Needs only this checkout's dlite/ and configs/drafter/ (README "Before the first GPU
# run" lists what to carry). Python: $PYTHON if set, else .venv/bin/python where it
# exists, else python3. Exit status 1 when a phase failed or decoding was not lossless.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m dlite.bench.device "$@"
