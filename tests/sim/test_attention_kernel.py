"""The attention-kernel model against the published figures it is built from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.sim.attention_kernel import DATA_PATH, AttentionKernel

DATA = json.loads(DATA_PATH.read_text())
GPUS = sorted(DATA["gpus"])
# The measuring GPUs' peaks, as each source states them.
H100 = dict(peak_flops=989e12, mem_bandwidth=3.352e12)
A100_PCIE = dict(peak_flops=312e12, mem_bandwidth=1.935e12)
LLAMA7B = dict(num_heads=32, num_kv_heads=32, head_dim=128, dtype_bytes=2)
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)


def decode_step(batch: int, context: int) -> tuple[int, int, float, int, int]:
    """Features of a step in which ``batch`` requests decode one token after ``context``."""
    kv = batch * (context + 1)
    return batch, batch, float(kv), kv, context + 1


def prefill_step(batch: int, length: int) -> tuple[int, int, float, int, int]:
    """Features of a step in which ``batch`` requests prefill ``length`` tokens each."""
    return batch, batch * length, batch * length * (length + 1) / 2, batch * length, length


@pytest.mark.parametrize("gpu", GPUS)
def test_arrays_give_exactly_the_scalar_result(gpu):
    kernel = AttentionKernel(gpu)
    rng = np.random.default_rng(7)
    for num_reqs, num_tokens in [(1, 1), (3, 3), (7, 900), (40, 40), (256, 2048)]:
        kv = rng.integers(num_tokens, 2_000_000, size=64).astype(np.float64)
        pairs = kv * rng.uniform(0.01, 3.0, size=64) * max(1.0, num_tokens / num_reqs)
        longest = np.minimum(kv, rng.integers(1, 200_000, size=64).astype(np.float64))
        kw = dict(LLAMA3_8B, peak_flops=700e12, mem_bandwidth=4.1e12)
        many = kernel.seconds(num_reqs, num_tokens, pairs, kv, longest, **kw)
        assert many.shape == kv.shape
        for i in range(kv.size):
            one = kernel.seconds(num_reqs, num_tokens, pairs[i], kv[i], longest[i], **kw)
            assert isinstance(one, float)
            assert one == many[i]


@pytest.mark.parametrize("gpu", GPUS)
def test_decode_time_grows_with_context_and_batch(gpu):
    kernel = AttentionKernel(gpu)
    contexts = [16, 100, 1000, 4000, 16000, 64000, 200000]
    batches = [1, 2, 4, 8, 16, 32, 64, 256]
    grid = np.array(
        [
            [kernel.seconds(*decode_step(b, c), **LLAMA3_8B, **H100) for c in contexts]
            for b in batches
        ]
    )
    assert (grid > 0).all()
    # Non-decreasing (tiny reads sit on the launch floor), and growing overall.
    assert (np.diff(grid, axis=1) >= 0).all(), "longer contexts must not be faster"
    assert (np.diff(grid, axis=0) >= 0).all(), "more requests must not be faster"
    assert (grid[:, -1] > 10 * grid[:, 0]).all() and (grid[-1] > grid[0]).all()


@pytest.mark.parametrize(("gpu", "peaks"), [("h100", H100), ("a100", A100_PCIE)])
def test_decode_bandwidth_at_large_batch_and_long_context_is_published(gpu, peaks):
    """Batch 64 x 8k (GQA) and batch 16 x 4k (MHA): FlashInfer's Figs. 9 and 6 read
    77-90 % of peak bandwidth; the model must land in that band."""
    kernel = AttentionKernel(gpu)
    for batch, context, shape in [(64, 8192, LLAMA3_8B), (16, 4096, LLAMA7B), (256, 4096, LLAMA7B)]:
        seconds = kernel.seconds(*decode_step(batch, context), **shape, **peaks)
        bytes_read = batch * (context + 1) * 2 * shape["num_kv_heads"] * 128 * 2
        utilisation = bytes_read / seconds / peaks["mem_bandwidth"]
        assert 0.75 <= utilisation <= 0.92, (batch, context, utilisation)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_gqa_decode_matches_flashinfer_figure_9(gpu):
    """The decode curves come from the MHA figure; the GQA figure (8x fewer bytes per
    token) checks that time follows bytes read, not the number of tokens."""
    check = DATA["checks"]["gqa_decode_batch64"]
    peaks = H100 if gpu == "h100" else A100_PCIE
    shape = {k: check[k] for k in ("num_heads", "num_kv_heads", "head_dim", "dtype_bytes")}
    kernel = AttentionKernel(gpu)
    for context, published in check[gpu]:
        seconds = kernel.seconds(*decode_step(check["batch"], context), **shape, **peaks)
        bytes_read = check["batch"] * context * 2 * shape["num_kv_heads"] * 128 * 2
        utilisation = 100 * bytes_read / seconds / peaks["mem_bandwidth"]
        assert abs(utilisation - published) <= 7.0, (context, utilisation, published)


def test_small_decode_pays_the_published_launch_floor():
    """One request over 32 keys: FlashInfer's Fig. 6 reads 2 % of the H100's bandwidth,
    i.e. about 8 us; the model keeps that floor for still smaller reads."""
    kernel = AttentionKernel("h100")
    tiny = kernel.seconds(*decode_step(1, 31), **LLAMA7B, **H100)
    tinier = kernel.seconds(*decode_step(1, 1), **LLAMA3_8B, **H100)
    assert 6e-6 <= tiny <= 10e-6
    assert tinier == pytest.approx(tiny, rel=0.05)


@pytest.mark.parametrize(
    ("gpu", "peaks", "length", "low", "high"),
    [
        # FlashAttention-3 paper Fig. 5d (FA3 row): 579 at 4k, 602 at 8k, 616 at 16k
        ("h100", H100, 4096, 550e12, 600e12),
        ("h100", H100, 16384, 590e12, 640e12),
        # FlashInfer blog Fig. 4, A100 PCIe, FlashAttention 2.4.2 causal: 184-198 at 8k-64k
        ("a100", A100_PCIE, 16384, 180e12, 205e12),
        ("a100", A100_PCIE, 65536, 185e12, 205e12),
    ],
)
def test_long_prefill_flops_are_published(gpu, peaks, length, low, high):
    kernel = AttentionKernel(gpu)
    batch = max(1, 16384 // length)
    step = prefill_step(batch, length)
    shape = dict(LLAMA7B, num_heads=16, num_kv_heads=16)
    seconds = kernel.seconds(*step, **shape, **peaks)
    achieved = 4 * 16 * 128 * step[2] / seconds
    assert low <= achieved <= high


def test_append_between_flashattention_and_flashinfer():
    """128 or 256 queries against a 64k cache on the A100, near the ridge point: the
    combination of compute and memory time must land between the published kernels."""
    check = DATA["checks"]["append_single_request_a100"]
    kernel = AttentionKernel("a100")
    kv_len = check["kv_len"]
    for q, published in check["tflops"].items():
        q = int(q)
        pairs = q * (kv_len + (q + 1) / 2)
        seconds = kernel.seconds(1, q, pairs, kv_len + q, kv_len + q, **LLAMA7B, **A100_PCIE)
        achieved = 4 * 32 * 128 * pairs / seconds / 1e12
        low, high = sorted(published.values())
        assert 0.95 * low <= achieved <= 1.1 * high, (q, achieved, published)


def test_sibling_gpu_scales_with_its_own_peaks():
    """The H200 uses the H100's curves: a large decode runs faster by about the bandwidth
    ratio, a small one keeps the measured floor."""
    h100, h200 = AttentionKernel("h100"), AttentionKernel("h200")
    h200_peaks = dict(peak_flops=989e12, mem_bandwidth=4.8e12)
    big = decode_step(128, 8192)
    ratio = h100.seconds(*big, **LLAMA3_8B, **H100) / h200.seconds(*big, **LLAMA3_8B, **h200_peaks)
    assert ratio == pytest.approx(4.8 / 3.352, rel=0.08)
    small = decode_step(1, 32)
    floor_ratio = h100.seconds(*small, **LLAMA3_8B, **H100) / h200.seconds(
        *small, **LLAMA3_8B, **h200_peaks
    )
    assert floor_ratio == pytest.approx(1.0, rel=0.05)


def test_empty_step_takes_no_time():
    kernel = AttentionKernel("h100")
    assert kernel.seconds(0, 0, 0.0, 0, 0, **LLAMA3_8B, **H100) == 0.0
    zeros = kernel.seconds(0, 0, np.zeros(3), np.zeros(3), np.zeros(3), **LLAMA3_8B, **H100)
    assert zeros.shape == (3,) and not zeros.any()


def test_unknown_gpu_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="v100") as err:
        AttentionKernel("v100")
    for gpu in GPUS:
        assert gpu in str(err.value)


def test_every_curve_and_point_names_a_source():
    sources = DATA["sources"]
    for name, source in sources.items():
        for field in ("title", "url", "figure", "date", "measured", "gpu", "kernel"):
            assert source.get(field), f"source {name} lacks {field}"
    assert DATA["combine_source"] in sources
    assert DATA["kernel_choice"]["source"] in sources
    for name, curve in DATA["prefill_curves"].items():
        assert curve["source"] in sources, name
        for point in curve["points"]:
            assert point["source"] in sources, (name, point)
    for name, curve in DATA["decode_curves"].items():
        assert curve["source"] in sources, name
    for name, check in DATA["checks"].items():
        assert check["source"] in sources, name
    for gpu, entry in DATA["gpus"].items():
        assert entry["prefill"] in DATA["prefill_curves"], gpu
        assert entry["decode"] in DATA["decode_curves"], gpu
        assert entry["scaling"], gpu


def test_bad_data_is_refused_naming_the_file(tmp_path):
    data = json.loads(DATA_PATH.read_text())
    data["decode_curves"]["h100_flashinfer"]["batch_16"][0][1] = 140.0
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"attention\.json"):
        AttentionKernel("h100", data_path=path)
