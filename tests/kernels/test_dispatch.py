"""Which module ``testbed.kernels`` dispatches to, without importing Triton's kernels here."""

from __future__ import annotations

import pytest
import torch

from testbed import kernels
from testbed.kernels import cpu_attention
from testbed.kernels import torch_attention as reference
from tests.kernels.cases import make_case


def test_torch_is_the_reference_and_auto_on_cpu_the_cpu_path():
    assert kernels.select_backend("torch", "cpu") is reference
    assert kernels.select_backend("cpu", "cpu") is cpu_attention
    assert kernels.select_backend("auto", "cpu") is cpu_attention
    assert kernels.select_backend("auto", torch.device("cpu")) is cpu_attention
    if not torch.cuda.is_available():
        assert kernels.select_backend() is cpu_attention


def test_triton_on_cpu_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"needs a CUDA device.*TRITON_INTERPRET=1"):
        kernels.select_backend("triton", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_triton_on_a_machine_without_cuda_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"is_available\(\) = False"):
        kernels.select_backend("triton", "cuda")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        kernels.select_backend("flash", "cpu")


def test_top_level_functions_run_the_cpu_path_on_cpu():
    g = torch.Generator().manual_seed(0)
    case = make_case([3, 17], 2, 64, 16, torch.float32, g)
    query = torch.randn(2, 4, 64, generator=g)
    args = (case.key_cache, case.value_cache, case.block_tables)
    out = kernels.paged_attention_decode(query, *args, case.seq_lens, 0.125)
    expected = cpu_attention.paged_attention_decode(query, *args, case.seq_lens, 0.125)
    assert torch.equal(out, expected)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = kernels.paged_attention_prefill(query, *args, starts, case.seq_lens, 0.125)
    assert torch.equal(
        out, cpu_attention.paged_attention_prefill(query, *args, starts, case.seq_lens, 0.125)
    )
    kc, vc = torch.zeros_like(case.key_cache), torch.zeros_like(case.value_cache)
    key, value = torch.cat(case.keys), torch.cat(case.values)
    assert kernels.reshape_and_cache(key, value, kc, vc, case.slot_mapping) is None
    assert torch.equal(kc[case.slot_mapping // 16, case.slot_mapping % 16], key)
