"""The CPU engine's fast path: packed oneDNN linear layers (q/k/v and gate/up
fused) and the fused C++ layer ops give what the plain torch modules give, and
each decoder layer in one C++ call gives what those ops give one by one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from testbed.engine import cpu_layer_ops, cpu_linear
from testbed.engine.factory import engine_model
from testbed.engine.model import RMSNorm, RotaryEmbedding
from testbed.engine.weights import build_model
from testbed.kernels import cpu_attention, cpu_native
from testbed.profiling.measure import TimedBackend
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 24, 64])  # halves of 4, 12 (8 lanes and 4), 32
def test_fused_rotary_equals_torchs_on_any_head_dim(native, dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    cfg, _, _ = engine_model("dummy-llama")
    rope = RotaryEmbedding(replace(cfg, head_dim=head_dim))
    positions = torch.randint(0, 2000, (29,), generator=g)
    qkv = torch.randn(29, 3, 5, head_dim, generator=g).to(dtype)
    k = qkv[:, 1]  # rows apart, as split from a fused product
    want = rope(positions, k)[0]
    rope.ops = cpu_native.layer_ops()
    got = rope(positions, k)[0]
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # rounded once, as torch rounds: at most one bfloat16 step apart
        step = want.float().abs().clamp_min(2**-20) * 2**-7
        assert ((got.float() - want.float()).abs() <= step).all()


def _counting(model) -> list[int]:
    """Counts the model's one-call layers (its ``layer_op`` wrapped)."""
    calls, op = [], model.layer_op

    def counted(*args):
        calls.append(1)
        return op(*args)

    model.layer_op = counted
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, None])  # decodes, short chunks, one prompt in tiles
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_each_layer_in_one_call_is_the_layer_by_layer_forward_bit_for_bit(
    native, dtype, chunk, qkv_bias
):
    if cpu_linear.unavailable_reason(dtype):
        pytest.skip(cpu_linear.unavailable_reason(dtype))
    cfg, _, _ = engine_model("dummy-llama")
    model = build_model(replace(cfg, qkv_bias=qkv_bias), None, dtype, torch.device("cpu"), seed=3)
    assert cpu_linear.pack(model) is None and cpu_layer_ops.enable(model) is None
    assert model.layer_op is not None
    calls = _counting(model)
    fused = run_prefill(model, PROMPT, chunk=chunk, block_size=16, backend=cpu_attention)
    chunks = len(range(0, len(PROMPT), chunk or len(PROMPT)))
    assert len(calls) == chunks * cfg.num_layers
    with cpu_layer_ops.layer_by_layer(model):
        plain = run_prefill(model, PROMPT, chunk=chunk, block_size=16, backend=cpu_attention)
    assert len(calls) == chunks * cfg.num_layers  # none while turned off
    assert torch.equal(fused, plain)


def test_one_call_layers_report_their_attention_time_to_a_timer(native):
    model = _model(torch.float32, True)
    calls = _counting(model)
    timed = TimedBackend(cpu_attention, torch.device("cpu"))
    run_prefill(model, PROMPT, chunk=5, block_size=16, backend=timed)
    assert calls and timed.seconds > 0
    timed.seconds = 0.0  # a new step's count
    assert timed.seconds == 0.0


def test_a_step_with_attention_on_torchs_route_runs_layer_by_layer(native, monkeypatch):
    """A prompt longer than the kernel's float32 share takes torch's attention: that
    step's layers run op by op, and give what they gave in one call each."""
    model = _model(torch.float32, True)
    want = run_prefill(model, PROMPT, block_size=16, backend=cpu_attention)
    calls = _counting(model)
    monkeypatch.setitem(cpu_attention.NATIVE_PAIRS, torch.float32, 100)  # 23 rows: torch's
    got = run_prefill(model, PROMPT, block_size=16, backend=cpu_attention)
    assert not calls
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_model_with_query_and_key_norms_runs_layer_by_layer(native):
    cfg, _, _ = engine_model("dummy-llama")
    model = build_model(replace(cfg, qk_norm=True), None, torch.float32, torch.device("cpu"), 3)
    assert cpu_linear.pack(model) is None and cpu_layer_ops.enable(model) is None
    assert model.layer_op is None
