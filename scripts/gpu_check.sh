#!/usr/bin/env bash
# Every GPU check and benchmark of the project, for a short lease of a CUDA machine.
#
#   scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]
#
# Runs the PARTS (default tests,bench,profile,fidelity,spec), in this order and
# within SECONDS (default 560) all told, each step cut short by its own limit and
# by what is left, so that a lease has room to run the script again (with the
# parts that failed or were cut):
#   1. the CUDA tests (kernels against references at real shapes, engine backends agree)
#   2. the kernel benchmark (decode bandwidth against the card's, prefill against
#      SDPA), the decode step of the Llama-3-8B shape against its memory roofline
#      (batches 1-256: where small batches sit far from it, the host bounds them),
#      one layer's operators (GEMMs, norms, rope, SiLU-and-mul, add, the Triton
#      decode kernel) on the Llama-2-7B and Llama-3-8B shapes against the
#      simulator's GPU operator model (benchmarks/gpu_operators.py), and nano-vllm's
#      workload (256 requests, inputs and outputs in [100, 1024])
#      on the Qwen3-0.6B shape against transformers (on 64 of the requests), and
#      the same model at 512 in / 128 out, where vLLM reports 12.1K tok/s on an H100
#   3. the profiler (its gpu grid, no point started after 90 s of it, so that the
#      replay and the table still fit) on the Llama-3-8B shape:
#      profiles/<hardware>/llama3-8b.csv, the simulator's calibration on this GPU
#   4. sim-vs-real fidelity with that profile (python -m experiments.fidelity: four
#      policies on Azure conv at 70% of capacity; needs Hydra and simpy, which
#      a bare machine lacks: see below), its real runs and tables packed into
#      fidelity.tgz, so that `python -m experiments.fidelity --reuse` re-simulates them anywhere
#   5. speculative decoding on stories260K (benchmarks/spec_decode.py: each proposer
#      at batch 1-256, real and simulated from a quick profile of it on this GPU)
# <hardware> is the conf/hardware entry of the GPU by its name (h200, h100, a100;
# testbed.hardware.gpu_entry), or GPU_CHECK_HARDWARE; on a GPU with no entry the
# profile and fidelity parts are skipped. The machine's python3 needs torch,
# triton, transformers, safetensors, pyyaml, numpy, pandas, pyarrow, matplotlib,
# pytest and hypothesis (the script names any missing at its start); the
# fidelity and spec parts need hydra, omegaconf and simpy too, and are skipped
# without them. Where .devsite/site exists its packages (copies of hydra, omegaconf, antlr4,
# simpy: pure Python) go on PYTHONPATH, and .devsite/traces serves as
# TESTBED_TRACES_DIR (copies of the shared traces; the folder is git-ignored and
# never committed; scripts/prepare_devsite.sh makes it). Writes at most nine
# files into OUT_DIR: run.log (everything printed), <hardware>-llama3-8b.csv (or,
# stopped at its limit, the points it measured: <hardware>-llama3-8b.partial.csv),
# fidelity.tgz and the benchmarks' JSON. Commit the JSON with the date and device
# under benchmarks/results/<hardware>/, and the profile as
# profiles/<hardware>/llama3-8b.csv.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]}
BUDGET=${2:-560}
PARTS=,${3:-tests,bench,profile,fidelity,spec},
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TESTBED_NO_BOOTSTRAP=1 MPLBACKEND=Agg
PY=${PYTHON:-python3}
MODEL=${GPU_CHECK_MODEL:-llama3-8b}
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
HW=${GPU_CHECK_HARDWARE:-$("$PY" -c "import torch
from testbed.hardware import gpu_entry
print(gpu_entry(torch.cuda.get_device_name()) or '')" 2>/dev/null)}
echo "hardware entry: ${HW:-none (set GPU_CHECK_HARDWARE)}"
"$PY" - <<'EOF'
import importlib.util
names = ("torch triton transformers safetensors yaml numpy pandas pyarrow matplotlib pytest "
         "hypothesis hydra omegaconf simpy").split()
missing = [n for n in names if importlib.util.find_spec(n) is None]
print("missing packages:", " ".join(missing) if missing else "none")
EOF
if [[ $PARTS == *,tests,* ]]; then
  step "CUDA tests" 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    --continue-on-collection-errors tests/kernels tests/engine
fi

if [[ $PARTS == *,bench,* ]]; then
  step "kernels" 50 "$PY" benchmarks/kernels_bench.py --out "$OUT/kernels_bench.json"
  step "decode step, $MODEL shape" 40 "$PY" benchmarks/decode_step.py --model "$MODEL" \
    --batch 1 8 64 256 --context 1024 --out "$OUT/decode_step.json"
  step "operators against the GPU operator model" 45 "$PY" benchmarks/gpu_operators.py \
    ${HW:+--hardware "$HW"} --out "$OUT/gpu_operators.json"
  step "nano-vllm's workload on the Qwen3-0.6B shape against transformers" 120 \
    "$PY" benchmarks/engine_throughput.py --model qwen3-0.6b --requests 256 \
    --prompt 100 1024 --output 100 1024 --max-num-seqs 256 --hf-requests 64 --hf-batch 64 \
    --out "$OUT/engine_throughput.json"
  step "512 in / 128 out on the Qwen3-0.6B shape (vLLM's published H100 figure: 12.1K tok/s)" 60 \
    "$PY" benchmarks/engine_throughput.py --model qwen3-0.6b --requests 256 \
    --prompt 512 512 --output 128 128 --max-num-seqs 256 --hf-requests 64 --hf-batch 64 \
    --out "$OUT/engine_throughput_512_128.json"
fi

PROFILE=profiles/$HW/$MODEL.csv
if [[ $PARTS == *,profile,* ]] && [ -n "$HW" ]; then
  step "profile of $MODEL on $HW" 180 "$PY" -m testbed.profiling --model "$MODEL" \
    --hardware "$HW" --grid "${GPU_CHECK_GRID:-auto}" --repeats 5 --replay-requests 40 \
    --max-grid-seconds 90 --out profiles && cp "$PROFILE" "$OUT/$HW-$MODEL.csv" ||
    cp "profiles/$HW/$MODEL.partial.csv" "$OUT/$HW-$MODEL.partial.csv"
fi

if [[ $PARTS == *,fidelity,* ]] && [ -f "$PROFILE" ] &&
  "$PY" -c "import hydra, simpy, pyarrow" 2>/dev/null; then
  FID=$(mktemp -d)
  # The engine's default batch limit (256, the largest decode batch of the gpu
  # grid); the trace's tenants and priority classes for vtc and priority. The KV
  # cache is each mode's own: memory x utilization - weights - activation peak.
  step "sim-vs-real fidelity" 200 "$PY" -m experiments.fidelity \
    --policies fcfs priority sjf vtc --traces azure_conv \
    --num-requests "${GPU_CHECK_REQUESTS:-200}" \
    --extra "hardware=$HW" "model=$MODEL" engine.max_num_seqs=256 \
    trace.num_tenants=4 trace.priority_classes=3 \
    --runs "$FID/runs" --out "$FID/tables" --wandb disabled
  tar -czf "$OUT/fidelity.tgz" --exclude='capacity-*' -C "$FID" . &&
    echo "packed $(du -h "$OUT/fidelity.tgz" | cut -f1)"
else
  echo "== sim-vs-real fidelity: skipped (not asked for, no profile, or no hydra/simpy/pyarrow)"
fi

if [[ $PARTS == *,spec,* ]] && ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  echo "== speculative decoding: skipped (no hydra/omegaconf: scripts/prepare_devsite.sh)"
elif [[ $PARTS == *,spec,* ]]; then
  step "speculative decoding, stories260K" 120 "$PY" benchmarks/spec_decode.py \
    --batches 1 4 16 64 256 --repeats 3 --hardware "${HW:-h200}" --out "$OUT/spec_decode.json"
fi
echo "done after $SECONDS s: $(ls "$OUT")"
