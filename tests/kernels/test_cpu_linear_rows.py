"""The C++ product for a few rows (``cpu_linear_rows.cpp``) against float64 sums,
within one rounding of the output (bfloat16) or float32 summation error; and the
packed linear layer that routes a few rows to it and more to oneDNN."""

from __future__ import annotations

import pytest
import torch

from testbed.engine import cpu_linear
from testbed.kernels import cpu_native

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops(native):
    return cpu_native.layer_ops()


def _dtype_or_skip(ops, dtype):
    if str(dtype).removeprefix("torch.") not in ops.linear_rows_dtypes():
        pytest.skip(f"this CPU lacks the instructions for {dtype} products")


def _check(out, x, w, bias):
    """``out`` is ``x @ w.T + bias`` up to float32 summation error in the sum of the
    products' magnitudes and, in bfloat16, one rounding of the result."""
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact += bias.double()
        scale += bias.double().abs()
    tol = 1e-5 * scale
    if out.dtype == torch.bfloat16:
        tol += 2.0**-8 * exact.abs()
    err = (out.double() - exact).abs()
    assert (err <= tol).all(), f"largest error {err.max():.3g} where {tol[err > tol].min():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_few_rows_equal_the_exact_product(ops, dtype, threads):
    _dtype_or_skip(ops, dtype)
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Odd widths (a partial group of 64 columns, an odd k), exact multiples, and
        # row counts below, at and past the 4 the kernel takes at a time.
        for n, k in [(100, 37), (64, 64), (1024, 512), (129, 1376), (8, 3)]:
            w = torch.randn(n, k, generator=g).to(dtype)
            packed = ops.pack_linear_rows(w)
            for rows in [1, 2, 3, 4, 5, 8, 9, 70]:
                x = torch.randn(rows, k, generator=g).to(dtype)
                for bias in (None, torch.randn(n, generator=g).to(dtype)):
                    out = torch.full((rows, n), float("nan"), dtype=dtype)
                    ops.linear_rows(out, x, packed, bias)
                    _check(out, x, w, bias)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packed_layer_routes_a_few_rows_to_the_kernel_and_more_to_onednn(
    ops, dtype, monkeypatch
):
    _dtype_or_skip(ops, dtype)
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 200, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    layer = cpu_linear.PackedLinear(w, b, cpu_linear.rows_ops(dtype))
    assert layer.max_rows == cpu_linear.ROWS[dtype] > 0
    calls = []
    monkeypatch.setattr(layer, "rows_ops", _Counting(ops, calls))
    for rows in (1, layer.max_rows, layer.max_rows + 1, 3 * layer.max_rows):
        x = torch.randn(rows, 200, generator=g).to(dtype)
        _check(layer(x), x, w, b)
    assert calls == [1, layer.max_rows]  # the other two ran on oneDNN


def test_bad_operands_are_named(ops):
    _dtype_or_skip(ops, torch.float32)
    w = torch.randn(70, 20)
    packed = ops.pack_linear_rows(w)
    with pytest.raises(RuntimeError, match="packed weight"):
        ops.linear_rows(torch.empty(2, 70), torch.randn(2, 21), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_rows(torch.empty(2, 70), torch.randn(2, 20), packed, torch.randn(69))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.linear_rows(torch.empty(2, 70), torch.randn(20, 2).T, packed, None)
    with pytest.raises(RuntimeError, match="not built"):
        ops.pack_linear_rows(w.half())


def test_turned_off_kernels_leave_every_row_count_on_onednn(monkeypatch):
    monkeypatch.setenv("TESTBED_CPU_KERNEL", "torch")
    assert cpu_linear.rows_ops(torch.float32) is None
    layer = cpu_linear.PackedLinear(torch.randn(8, 4), None, cpu_linear.rows_ops(torch.float32))
    assert layer.max_rows == 0


class _Counting:
    """The ops, recording the rows of each ``linear_rows`` call."""

    def __init__(self, ops, calls):
        self.ops, self.calls = ops, calls

    def linear_rows(self, out, x, packed, bias):
        self.calls.append(x.shape[0])
        self.ops.linear_rows(out, x, packed, bias)
