"""On CUDA: the Triton kernels and the torch reference give the engine the same tokens."""

from __future__ import annotations

import pytest
import torch

from testbed.core import SamplingParams
from testbed.engine.llm import LLM
from tests.engine.test_engine import prompts

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_greedy_tokens_with_either_attention_backend(dtype):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            "dummy-llama",
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            num_kv_blocks=256,
            block_size=16,
            max_num_batched_tokens=64,
        )
        outs[backend] = [o.token_ids for o in llm.generate(prompts(12), greedy)]
    if dtype == "float32":
        assert outs["torch"] == outs["triton"]
    else:  # bf16 rounding may flip a near-tie late in a sequence: compare the starts
        assert [t[:4] for t in outs["torch"]] == [t[:4] for t in outs["triton"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_weights_are_made_on_the_device_in_its_dtype():
    from testbed.engine.factory import engine_model
    from testbed.engine.weights import build_model

    cfg, _, _ = engine_model("dummy-llama")
    a = build_model(cfg, None, torch.bfloat16, torch.device("cuda"), seed=5)
    b = build_model(cfg, None, torch.bfloat16, torch.device("cuda"), seed=5)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16, name
        assert torch.isfinite(p).all() and torch.equal(p, q), name
        if p.dim() == 2 and "embed_tokens" not in name:  # unit gain: std 1/sqrt(fan_in)
            assert abs(p.float().std().item() * p.shape[1] ** 0.5 - 1) < 0.1, name
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_kernel_compiles_after_the_engine_is_built():
    # build_engine warms the kernels up; the steps of any batch and context then
    # launch only variants compiled already (a compile would stall a step seconds).
    from testbed.kernels import triton_kernels as tk

    def compiled() -> dict[str, int]:
        counts = {}
        for name in ("_reshape_and_cache_kernel", "_decode_kernel", "_decode_reduce_kernel",
                     "_prefill_kernel"):  # fmt: skip
            caches = getattr(getattr(tk, name), "device_caches", None)
            if not caches:
                pytest.skip("this triton keeps its compiled kernels elsewhere")
            counts[name] = sum(len(c[0]) for c in caches.values())
        return counts

    llm = LLM("dummy-llama", device="cuda", dtype="bfloat16", attention_backend="triton",
              num_kv_blocks=2048, block_size=16, max_num_batched_tokens=512)  # fmt: skip
    before = compiled()
    sampling = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    lengths = [1, 15, 16, 17, 100, 700, 1500]  # unsplit and split decodes, chunks, mixes
    llm.generate([[7] * n for n in lengths * 3], sampling)
    assert compiled() == before
