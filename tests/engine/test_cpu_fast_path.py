"""The CPU engine's fast path: packed oneDNN linear layers (q/k/v and gate/up
fused) and the fused C++ layer ops give what the plain torch modules give."""

from __future__ import annotations

import pytest
import torch

from testbed.engine import cpu_layer_ops, cpu_linear
from testbed.engine.factory import engine_model
from testbed.engine.model import RMSNorm, RotaryEmbedding
from testbed.engine.weights import build_model
from testbed.kernels import cpu_attention, cpu_native
from tests.engine.helpers import run_prefill

PROMPT = [1, 17, 250, 3, 99, 42, 7, 7, 8, 120, 33, 5, 64, 200, 11, 2, 150, 6, 9, 10, 12, 13, 14]


def _model(dtype, fast: bool):
    cfg, _, _ = engine_model("dummy-llama")
    model = build_model(cfg, None, dtype, torch.device("cpu"), seed=3)
    if fast:
        assert cpu_linear.pack(model) is None
        assert cpu_layer_ops.enable(model) is None
    return model


@pytest.fixture
def native():
    if cpu_native.layer_ops() is None:
        pytest.skip(cpu_native.unavailable_reason())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fast_path_gives_the_plain_modules_logits(native, dtype):
    if cpu_linear.unavailable_reason(dtype):
        pytest.skip(cpu_linear.unavailable_reason(dtype))
    plain, fast = _model(dtype, False), _model(dtype, True)
    want = run_prefill(plain, PROMPT, chunk=5, block_size=16, backend=cpu_attention)
    got = run_prefill(fast, PROMPT, chunk=5, block_size=16, backend=cpu_attention)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:  # other sums' order: bfloat16 roundings may differ, a few units of it
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_packing_keeps_the_modules_weights_and_is_done_once():
    plain, fast = _model(torch.float32, False), _model(torch.float32, True)
    assert plain.state_dict().keys() == fast.state_dict().keys()
    for name, p in fast.state_dict().items():
        assert torch.equal(p, plain.state_dict()[name]), name
    head = fast.packed_head
    assert cpu_linear.pack(fast) is None and fast.packed_head is head
    assert len(cpu_linear.packed_linears(fast)) == 4 * fast.config.num_layers
    assert "oneDNN, packed weights" in cpu_linear.route(fast)


def test_packing_can_be_turned_off_and_says_so(monkeypatch):
    monkeypatch.setenv("TESTBED_CPU_LINEAR", "torch")
    model = _model(torch.float32, False)
    assert cpu_linear.pack(model) == "turned off (TESTBED_CPU_LINEAR=torch)"
    assert model.packed_head is None and "TESTBED_CPU_LINEAR" in cpu_linear.route(model)
    assert cpu_linear.unavailable_reason(torch.float16) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_equal_the_torch_modules(native, dtype):
    g = torch.Generator().manual_seed(0)
    ops = cpu_native.layer_ops()
    x = torch.randn(37, 256, generator=g).to(dtype)
    norm = RMSNorm(256, 1e-5).to(dtype)
    norm.weight.data = torch.rand(256, generator=g).to(dtype) + 0.5
    fused_norm = torch.empty_like(x)
    ops.rms_norm(fused_norm, x, norm.weight, 1e-5)
    residual, h = x.clone(), torch.randn(37, 256, generator=g).to(dtype)
    summed = torch.empty_like(x)
    ops.add_rms_norm(residual, h, norm.weight, summed, 1e-5)
    gate_up = torch.randn(37, 2 * 300, generator=g).to(dtype)
    act = torch.empty(37, 300, dtype=dtype)
    ops.silu_and_mul(act, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    cfg, _, _ = engine_model("dummy-llama")
    rope = RotaryEmbedding(cfg)
    positions = torch.randint(0, 500, (37,), generator=g)
    qkv = torch.randn(37, 3, 4, cfg.head_dim, generator=g).to(dtype)
    q = qkv[:, 0]  # a view whose rows are apart, as split from a fused product
    want_q = rope(positions, q)[0]
    rope.ops = ops
    got_q = rope(positions, q)[0]
    for got, want in [
        (fused_norm, norm(x)),
        (residual, x + h),
        (summed, norm(x + h)),
        (act, torch.nn.functional.silu(gate) * up),
        (got_q, want_q),
    ]:
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # rounded where torch rounds: at most one bfloat16 step apart, rarely
            step = want.float().abs().clamp_min(2**-20) * 2**-7
            assert ((got.float() - want.float()).abs() <= step).all()
            assert (got != want).float().mean() < 0.01
