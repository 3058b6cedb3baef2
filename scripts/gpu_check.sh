#!/usr/bin/env bash
# Every GPU check and benchmark of the project, for a short lease of a CUDA machine.
#
#   scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]
#
# Runs the PARTS (default tests,profile,fidelity,bench,spec), in this order and within
# SECONDS (default 560) all told, each step cut short by its own limit and by
# what is left:
#   1. the CUDA tests (kernels against references at real shapes, engine backends agree)
#   2. the profiler (its gpu grid, no point started after 120 s of it, so that
#      the replay and the table still fit) on the Llama-3-8B shape: profiles/h200/llama3-8b.csv, the
#      simulator's calibration on this GPU
#   3. sim-vs-real fidelity with that profile (python -m experiments.fidelity: four
#      policies on Azure conv at 70% of capacity; needs Hydra and simpy, which
#      a bare machine lacks: see below), its real runs and tables packed into
#      fidelity.tgz, so that `python -m experiments.fidelity --reuse` re-simulates them anywhere
#   4. the kernel, decode-step and offline-throughput benchmarks
#   5. speculative decoding on stories260K (benchmarks/spec_decode.py: each proposer
#      at batch 1-256, real and simulated from a quick profile of it on this GPU)
# The machine's python3 needs torch, triton, transformers, safetensors, pyyaml,
# numpy, pandas, matplotlib and pytest. Where .devsite/site exists its packages
# (copies of hydra, omegaconf, antlr4, simpy: pure Python) go on PYTHONPATH, and
# .devsite/traces serves as TESTBED_TRACES_DIR (copies of the shared traces; the
# folder is git-ignored and never committed). Writes at most eight files into
# OUT_DIR: run.log (everything printed), h200-llama3-8b.csv (or, stopped at its
# limit, the points it measured: h200-llama3-8b.partial.csv), fidelity.tgz and the
# benchmarks' JSON. Commit the JSON with the date and device under
# benchmarks/results/<device>/, and the profile as profiles/h200/llama3-8b.csv.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]}
BUDGET=${2:-560}
PARTS=,${3:-tests,profile,fidelity,bench,spec},
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TESTBED_NO_BOOTSTRAP=1 MPLBACKEND=Agg
PY=${PYTHON:-python3}
MODEL=${GPU_CHECK_MODEL:-llama3-8b}
HW=${GPU_CHECK_HARDWARE:-h200}
# The project from this checkout (no bootstrap here, so nothing installs it).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d .devsite/site ] && export PYTHONPATH=$PWD/.devsite/site${PYTHONPATH:+:$PYTHONPATH}
[ -d .devsite/traces ] && export TESTBED_TRACES_DIR=$PWD/.devsite/traces
[ -d .devsite/models ] && export TESTBED_MODELS_DIR=$PWD/.devsite/models
exec > >(tee -a "$OUT/run.log") 2>&1

left() { echo $((BUDGET - SECONDS)); }
# step NAME MAX_SECONDS COMMAND...: runs COMMAND for at most MAX_SECONDS and what is left.
step() {
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  local t
  t=$(left)
  ((t > limit)) && t=$limit
  if ((t < 15)); then
    echo "== $name: skipped, $(left) s left"
    return 1
  fi
  echo "== $name (at most $t s; $(date -u +%T))"
  timeout -k 30 "$t" "$@"  # SIGTERM first: each step writes what it measured
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ $PARTS == *,tests,* ]]; then
  step "CUDA tests" 110 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --continue-on-collection-errors tests/kernels tests/engine
fi

PROFILE=profiles/$HW/$MODEL.csv
if [[ $PARTS == *,profile,* ]]; then
  step "profile of $MODEL on $HW" 240 "$PY" -m testbed.profiling --model "$MODEL" \
    --hardware "$HW" --grid "${GPU_CHECK_GRID:-auto}" --repeats 5 --replay-requests 40 \
    --max-grid-seconds 120 --out profiles && cp "$PROFILE" "$OUT/$HW-$MODEL.csv" ||
    cp "profiles/$HW/$MODEL.partial.csv" "$OUT/$HW-$MODEL.partial.csv"
fi

if [[ $PARTS == *,fidelity,* ]] && [ -f "$PROFILE" ] && "$PY" -c "import hydra, simpy" 2>/dev/null; then
  FID=$(mktemp -d)
  # The engine's default batch limit (256, the largest decode batch of the gpu
  # grid); a fixed KV cache of 32768 blocks (524k tokens, 69 GB of Llama-3-8B's;
  # not most of the card: the runs share one process, each freeing the last
  # one's before it builds its own); the trace's tenants and priority classes
  # for vtc and priority.
  step "sim-vs-real fidelity" 200 "$PY" -m experiments.fidelity \
    --policies fcfs priority sjf vtc --traces azure_conv \
    --num-requests "${GPU_CHECK_REQUESTS:-200}" \
    --extra "hardware=$HW" "model=$MODEL" engine.max_num_seqs=256 \
    engine.num_kv_blocks=32768 trace.num_tenants=4 trace.priority_classes=3 \
    --runs "$FID/runs" --out "$FID/tables" --wandb disabled
  tar -czf "$OUT/fidelity.tgz" --exclude='capacity-*' -C "$FID" . &&
    echo "packed $(du -h "$OUT/fidelity.tgz" | cut -f1)"
else
  echo "== sim-vs-real fidelity: skipped (not asked for, no profile, or no hydra/simpy)"
fi

if [[ $PARTS == *,bench,* ]]; then
  step "kernels" 60 "$PY" benchmarks/kernels_bench.py --out "$OUT/kernels_bench.json"
  step "decode step, $MODEL shape" 45 "$PY" benchmarks/decode_step.py --model "$MODEL" \
    --batch 1 64 256 --context 1024 --out "$OUT/decode_step.json"
  step "offline throughput against transformers, Qwen3-0.6B shape, 512 in / 128 out" 120 \
    "$PY" benchmarks/engine_throughput.py --model qwen3-0.6b --requests 256 \
    --prompt 512 512 --output 128 128 --max-num-seqs 256 --hf-batch 64 \
    --out "$OUT/engine_throughput.json"
fi
if [[ $PARTS == *,spec,* ]]; then
  step "speculative decoding, stories260K" 150 "$PY" benchmarks/spec_decode.py \
    --batches 1 4 16 64 256 --repeats 3 --hardware "$HW" --out "$OUT/spec_decode.json"
fi
echo "done after $SECONDS s: $(ls "$OUT")"
