#!/usr/bin/env bash
# Prepare .devsite/ for scripts/gpu_check.sh on a bare CUDA machine without network:
#
#   scripts/prepare_devsite.sh
#
# Copies from this checkout's .venv the pure-Python packages the fidelity step
# needs and such a machine lacks (hydra, omegaconf, antlr4, simpy) into
# .devsite/site, and the Azure conv and Mooncake conversation traces from the
# shared traces folder ($TESTBED_TRACES_DIR, else ../shared/traces) into
# .devsite/traces, and the shared stories260K model ($TESTBED_MODELS_DIR, else
# ../shared/models) into .devsite/models. The folder is git-ignored (.git/info/exclude): never committed;
# take it along to the CUDA machine with the checkout and run gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TRACES=${TESTBED_TRACES_DIR:-../shared/traces}
site=$("$PY" -c "import simpy, os; print(os.path.dirname(os.path.dirname(simpy.__file__)))")
[ -d "$TRACES/azure_llm_2023" ] || { echo "no shared traces at $TRACES (set TESTBED_TRACES_DIR)"; exit 1; }
grep -qx "/.devsite/" .git/info/exclude 2>/dev/null || echo "/.devsite/" >> .git/info/exclude
rm -rf .devsite
mkdir -p .devsite/site .devsite/traces/azure_llm_2023 .devsite/traces/mooncake
for pkg in antlr4 hydra omegaconf simpy; do
  cp -r "$site/$pkg" .devsite/site/
done
find .devsite -name __pycache__ -prune -exec rm -rf {} +
cp "$TRACES"/azure_llm_2023/{AzureLLMInferenceTrace_conv.csv,LICENSE-azure.txt} .devsite/traces/azure_llm_2023/
cp "$TRACES"/mooncake/{conversation_trace.jsonl,LICENSE-mooncake.txt} .devsite/traces/mooncake/
MODELS=${TESTBED_MODELS_DIR:-../shared/models}
if [ -d "$MODELS/stories260K" ]; then
  mkdir -p .devsite/models && cp -r "$MODELS/stories260K" .devsite/models/
else
  echo "no stories260K at $MODELS: the speculative-decoding benchmark will be skipped"
fi
echo "prepared .devsite ($(du -sh .devsite | cut -f1)): bash scripts/gpu_check.sh OUT_DIR on the CUDA machine"
