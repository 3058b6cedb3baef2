#!/usr/bin/env bash
# Every GPU check and benchmark of the project, for a short lease of a CUDA machine.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Installs nothing (the machine's python3 needs torch, triton, transformers,
# safetensors, tokenizers, pyyaml, numpy, pandas and pytest; no Hydra, simpy or
# W&B); about 7 minutes on an H200. Writes at most eight files into OUT_DIR:
# device.txt, pytest_gpu.log, bench.log, the benchmarks' JSON and the profile
# h200-llama3-8b.csv. Commit the JSON with the date and device under
# benchmarks/results/<device>/, and the profile as profiles/h200/llama3-8b.csv.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TESTBED_NO_BOOTSTRAP=1
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1

# CUDA tests: kernels against references at real shapes, engine backends agree.
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
  tests/kernels tests/engine \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest exit: $?" >> "$OUT/pytest_gpu.log"

{
  echo "== kernels"; timeout 150 "$PY" benchmarks/kernels_bench.py --out "$OUT/kernels_bench.json"
  echo "== decode step, Llama-3-8B shape"
  timeout 120 "$PY" benchmarks/decode_step.py --model llama3-8b --batch 1 64 256 \
    --context 1024 --out "$OUT/decode_step.json"
  echo "== offline throughput against transformers, Qwen3-0.6B shape, 512 in / 128 out"
  timeout 150 "$PY" benchmarks/engine_throughput.py --model qwen3-0.6b --requests 256 \
    --prompt 512 512 --output 128 128 --max-num-seqs 256 --hf-batch 64 \
    --out "$OUT/engine_throughput.json"
  echo "== profile of the Llama-3-8B shape (the simulator's calibration on this GPU)"
  timeout 150 "$PY" -m testbed.profiling --model llama3-8b --hardware h200 --repeats 5 \
    --replay-requests 40 --out "$OUT/profiles" && cp "$OUT/profiles/h200/llama3-8b.csv" \
    "$OUT/h200-llama3-8b.csv" && rm -r "$OUT/profiles"
} > "$OUT/bench.log" 2>&1
echo "done: $(ls "$OUT")"
