"""Schedule parity with vLLM V1: the same request stream through vLLM 0.34's own
scheduler (replayed on the CPU, ``../shared/tools/vllm_replay``) and through
``testbed.core``'s, compared step by step.

| module | what |
| --- | --- |
| `streams.py` | synthetic streams (shared prefixes, priorities) in the replay tool's format |
| `reference.py` | where the replay tool and its venv are; runs vLLM's side in a subprocess |
| `ours.py` | runs our scheduler on the same stream with the same clock and tokens |
| `compare.py` | the two per-step tables side by side: identical steps, the first divergence |
| `vllm_shim.py` | run by the replay venv's python: the tool's main, with per-request priorities |
| `cli.py` | the command line (``python -m experiments.vllm_parity``) |
| `matrix.py` | the comparison over 15 streams and settings (``... vllm_parity.matrix``) |
"""
