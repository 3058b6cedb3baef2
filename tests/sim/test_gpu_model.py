"""The GPU operator step model's composition: layers, all-reduces, pipeline
hand-overs, MoE experts, a sibling GPU's scaling, and the replica's memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from testbed.hardware import spec_sheet
from testbed.models import ModelSpec, model_entry, num_kv_blocks
from testbed.sim.gpu_model import GPUStepModel, Parallelism, replica_memory

OPS = ("qkv", "o", "mlp_up", "mlp_down", "input_norm", "post_norm", "rope", "act", "add")


class FakeLayer:
    source, measured = "fake table", True

    def seconds(self, tokens):
        return {op: 1e-6 * (i + 1) * (1 + tokens / 100) for i, op in enumerate(OPS)}

    def emb_s(self, tokens):
        return 1e-6


class FakeOps:
    """Operator times with known values: every GEMM costs 1 us plus its FLOPs at 1 PFLOP/s
    or its bytes at 1 TB/s, whichever is slower."""

    def __init__(self):
        self.layers = []

    def layer(self, shape, tp):
        self.layers.append((shape, tp))
        return FakeLayer()

    def gemm_s(self, m, k, n, dtype_bytes=2):
        return 1e-6 + max(2 * m * k * n / 1e15, (k * n + m * (k + n)) * dtype_bytes / 1e12)

    def elementwise_s(self, tokens, width, kind=None):
        return 1e-6 + 4 * tokens * width / 1e12


class FakeAttention:
    source = "fake kernel"

    def seconds(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv, **shape):
        kv = np.asarray(kv_tokens, dtype=np.float64)
        out = 1e-6 + kv * shape["num_kv_heads"] * 1e-9 + np.asarray(attn_pairs) * 1e-12
        return float(out) if out.ndim == 0 else out

    def shaped(self, **shape):
        fake = self

        class Shaped:
            def one(self, *step):
                return fake.seconds(*step, **shape)

            many = one

        return Shaped()


class FakeCollective:
    source = "fake nccl"

    def __init__(self):
        self.reduces = []

    def all_reduce_s(self, nbytes, n):
        self.reduces.append((nbytes, n))
        return 0.0 if n == 1 else 5e-6 + nbytes / 1e11

    def send_recv_s(self, nbytes):
        return 3e-6 + nbytes / 1e11


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(model_entry(name)["hf_config"], name=name)


def model(name="llama3-70b", hw="h100", tp=1, pp=1, **kw):
    return GPUStepModel(
        spec(name),
        spec_sheet(hw),
        "bfloat16",
        Parallelism(tp, pp),
        ops=kw.get("ops", FakeOps()),
        attention=FakeAttention(),
        collective=kw.get("collective", FakeCollective()),
    )


def test_the_array_path_equals_the_scalar_path_bit_for_bit():
    m = model(tp=4)
    pairs = np.array([100.0, 5000.0, 123456.0])
    kv = np.array([100, 5000, 123456])
    many = m.predict_many(8, 8, pairs, kv, kv)
    for i in range(3):
        assert many[i] == m.predict(8, 8, float(pairs[i]), int(kv[i]), int(kv[i]))


def test_tensor_parallelism_adds_two_all_reduces_per_layer_of_the_hidden_states():
    coll = FakeCollective()
    m = model(tp=4, collective=coll)
    m.fixed_s(4, 64)
    layer_reduces = [r for r in coll.reduces if r == (64 * 8192 * 2, 4)]
    assert len(layer_reduces) == 1  # priced once, charged for every layer
    one = model(tp=1).fixed_s(4, 64)
    four = m.fixed_s(4, 64)
    reduce_s = 5e-6 + 64 * 8192 * 2 / 1e11
    logits_s = 5e-6 + 4 * (128256 // 4) * 2 / 1e11
    head_1 = FakeOps().gemm_s(4, 8192, 128256)
    head_4 = FakeOps().gemm_s(4, 8192, 128256 // 4)
    # same fake layer times per rank: the difference is the collectives and the head
    assert four - one == pytest.approx(2 * 80 * reduce_s + logits_s + head_4 - head_1)


def test_attention_sees_each_ranks_share_of_the_kv_heads():
    one = model(tp=1)
    eight = model(tp=8)
    assert (one.heads, one.kv_heads) == (64, 8)
    assert (eight.heads, eight.kv_heads) == (8, 1)


def test_pipeline_stages_add_their_hand_overs_and_nothing_else():
    base = model(pp=1).fixed_s(2, 32)
    piped = model(pp=4).fixed_s(2, 32)
    assert piped - base == pytest.approx(3 * (3e-6 + 2 * 32 * 8192 * 2 / 1e11))


def test_moe_experts_touched_grow_from_top_k_to_all_experts():
    m = model("qwen3-30b-a3b")
    assert m.experts_touched(1) == pytest.approx(8)
    assert m.experts_touched(4096) == pytest.approx(128, rel=1e-6)
    assert 8 < m.experts_touched(16) < 128
    # decode batches read more expert weights as they grow, so a token gets cheaper
    per_token = [m.fixed_s(n, n) / n for n in (1, 8, 64)]
    assert per_token[0] > per_token[1] > per_token[2]
    # a batch of one reads top-k experts' weights: about k/E of the expert bytes
    mixtral = model("mixtral-8x7b")
    assert mixtral.experts_touched(1) == pytest.approx(2)


def test_a_sibling_gpu_scales_memory_bound_operators_by_bandwidth():
    h100 = model(hw="h100")
    h200 = GPUStepModel(
        spec("llama3-70b"),
        spec_sheet("h200"),
        "bfloat16",
        ops=FakeOps(),
        attention=FakeAttention(),
        collective=FakeCollective(),
    )
    h200.base = spec_sheet("h100")  # as if priced from h100's tables
    ratio = spec_sheet("h100").mem_bandwidth / spec_sheet("h200").mem_bandwidth
    # one token: every operator memory-bound
    assert h200._layer_ops(1)["mlp_up"] == pytest.approx(h100._layer_ops(1)["mlp_up"] * ratio)
    # many tokens: the GEMMs are compute-bound on both, the same FLOP/s
    assert h200._layer_ops(4096)["mlp_up"] == pytest.approx(h100._layer_ops(4096)["mlp_up"])


def test_splits_the_model_does_not_allow_are_refused():
    with pytest.raises(ValueError, match="attention heads"):
        model("llama3-70b", tp=3)
    with pytest.raises(ValueError, match="layers"):
        model("mistral-7b", pp=64)
    with pytest.raises(ValueError, match="integer >= 1"):
        Parallelism(0, 1)


def test_a_replicas_kv_cache_is_what_all_its_gpus_leave():
    s, hw = spec("llama3-70b"), spec_sheet("h100")
    with pytest.raises(ValueError, match="no room"):
        num_kv_blocks(
            s, "bfloat16", 16, memory=replica_memory(s, hw, "bfloat16", 0.9, Parallelism())
        )
    tp4 = Parallelism(4)
    blocks4 = num_kv_blocks(
        tp4.kv_spec(s), "bfloat16", 16, memory=replica_memory(s, hw, "bfloat16", 0.9, tp4)
    )
    tp8 = Parallelism(8)
    blocks8 = num_kv_blocks(
        tp8.kv_spec(s), "bfloat16", 16, memory=replica_memory(s, hw, "bfloat16", 0.9, tp8)
    )
    left4 = 4 * 80e9 * 0.9 - s.weight_bytes("bfloat16") - 4 * hw.activation_reserve_bytes
    assert blocks4 == int(left4 // (16 * s.kv_bytes_per_token("bfloat16")))
    assert blocks8 > 2 * blocks4  # the weights are paid once
    # more ranks than KV heads: each rank holds a copy of a head
    tp16 = Parallelism(16)
    assert tp16.kv_spec(s).kv_bytes_per_token("bfloat16") == 2 * s.kv_bytes_per_token("bfloat16")
    assert replace(s, num_kv_heads=8) == tp8.kv_spec(s)


def test_a_tensor_parallel_cluster_reports_per_gpu_figures_and_its_sources(tmp_path):
    from tests.sim.helpers import run

    m = run(
        tmp_path,
        "model=llama3-70b",
        "hardware=h100",
        "engine.tensor_parallel_size=4",
        "cluster=replicas4",
        "cluster.num_replicas=2",
        "trace.num_requests=40",
        "trace.rate=4",
    )
    assert (m["num_gpus"], m["tensor_parallel_size"], m["latency_model"]) == (8, 4, "operators")
    assert m["throughput_output_tok_s_per_gpu"] == m["throughput_output_tok_s"] / 8
    assert m["goodput_req_s_per_gpu"] == m["goodput_req_s"] / 8
    assert "Llama-2-70b" in m["latency_source_linear"]  # the same layer shape, measured
    assert "NCCL" in m["latency_source_collectives"]
    # the KV cache of four GPUs' memory, less the weights once
    s, hw = spec("llama3-70b"), spec_sheet("h100")
    left = 4 * 80e9 * 0.9 - s.weight_bytes("bfloat16") - 4 * hw.activation_reserve_bytes
    assert m["num_kv_blocks"] == int(left // (16 * s.kv_bytes_per_token("bfloat16")))


def test_a_replica_whose_weights_leave_no_kv_cache_is_refused(tmp_path):
    from testbed.errors import InputError
    from tests.sim.helpers import run

    with pytest.raises(InputError, match="no room for a KV cache"):
        run(tmp_path, "model=llama3-70b", "hardware=h100", "engine.tensor_parallel_size=2")
    with pytest.raises(InputError, match="attention heads"):
        run(tmp_path, "model=llama3-70b", "hardware=h100", "engine.tensor_parallel_size=3")
