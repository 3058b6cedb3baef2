"""The Triton kernels compile for an H200 (sm_90) without a GPU, and do not spill.

The interpreter runs the kernels' Python, not the compiler: code the compiler rejects
(or tiles that spill registers to local memory) would pass there and fail, or crawl,
on the GPU. Here each wrapper is called at realistic shapes with its kernels'
launches captured instead of run, and every captured launch is compiled ahead of time
for sm_90 through Triton's own argument specialization (the same signature, constants
and alignment attributes a real launch would get); the cubin's resource usage must
show no stack (spilled registers). This uses Triton internals, so a Triton whose
internals differ skips rather than fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
if triton.knobs.runtime.interpret:
    pytest.skip("TRITON_INTERPRET is set: the kernels are not compiled", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    TARGET = GPUTarget("cuda", 90, 32)
    BACKEND = make_backend(TARGET)
except Exception as exc:  # no CUDA backend in this triton, or other internals
    pytest.skip(f"cannot compile ahead of time with this triton: {exc}", allow_module_level=True)

from testbed.kernels import triton_kernels as tk  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

KERNELS = (
    "_reshape_and_cache_kernel",
    "_decode_kernel",
    "_decode_reduce_kernel",
    "_prefill_kernel",
)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class Captured:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def bind(fn, args, kwargs):
    """Triton's own binding of a launch for sm_90: its bound arguments, their
    specialization (types, constants, alignment) and the options."""
    try:
        binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
        return binder(*args, **kwargs)
    except Exception as exc:
        pytest.skip(f"this triton's launch internals differ: {exc!r}")


def compile_for_sm90(fn, args, kwargs):
    kwargs = dict(kwargs, debug=False)
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(triton.knobs.compilation, knob):
            kwargs[knob] = getattr(triton.knobs.compilation, knob)
    bound, specialization, options = bind(fn, args, kwargs)
    try:
        options, signature, constexprs, attrs = fn._pack_args(
            BACKEND, kwargs, bound, specialization, options
        )
    except Exception as exc:
        pytest.skip(f"this triton's launch internals differ: {exc!r}")
    src = ASTSource(fn, signature, constexprs, attrs)
    return compile(src, target=TARGET, options=options.__dict__)


def stack_bytes(kernel) -> int | None:
    """Bytes of stack (spills) in the cubin, or None without cuobjdump."""
    tool = str(CUOBJDUMP) if CUOBJDUMP.exists() else shutil.which("cuobjdump")
    if tool is None:
        return None
    path = Path(kernel.metadata.name + ".cubin")
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernels-test-{os.getpid()}-{path}"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True)
    finally:
        cubin.unlink()
    found = re.findall(r"STACK:(\d+)", out.stdout)
    return int(found[0]) if found else None


def caches(num_kv_heads, head_dim, dtype, block_size=16):
    # Only strides and dtypes matter: nothing runs.
    kc = torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=dtype)
    return kc, kc.clone()


def reshape_case(dtype, head_dim, kv_heads=8):
    key = torch.zeros(256, kv_heads, head_dim, dtype=dtype)
    tk.reshape_and_cache(key, key, *caches(kv_heads, head_dim, dtype), torch.zeros(256).long())


def decode_case(dtype, head_dim, heads, kv_heads, batch, context):
    query = torch.zeros(batch, heads, head_dim, dtype=dtype)
    tables = torch.zeros(batch, context // 16, dtype=torch.int32)
    lens = torch.ones(batch, dtype=torch.int32)
    kc, vc = caches(kv_heads, head_dim, dtype)
    tk.paged_attention_decode(query, kc, vc, tables, lens, 0.1, max_context_len=context)


def prefill_case(dtype, head_dim, heads, kv_heads, num_seqs, q_len):
    query = torch.zeros(num_seqs * q_len, heads, head_dim, dtype=dtype)
    starts = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    tables = torch.zeros(num_seqs, 256, dtype=torch.int32)
    lens = torch.full((num_seqs,), 4096, dtype=torch.int32)
    kc, vc = caches(kv_heads, head_dim, dtype)
    tk.paged_attention_prefill(query, kc, vc, tables, starts, lens, 0.1)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = {
    "reshape bf16 d128": lambda: reshape_case(BF16, 128),
    "reshape fp32 d80": lambda: reshape_case(FP32, 80),
    "decode bf16 d128 gqa4 split": lambda: decode_case(BF16, 128, 32, 8, 16, 4096),
    "decode bf16 d128 gqa4 unsplit": lambda: decode_case(BF16, 128, 32, 8, 256, 4096),
    "decode bf16 d256 gqa2 split": lambda: decode_case(BF16, 256, 16, 8, 1, 16384),
    "decode fp16 d80 gqa7": lambda: decode_case(FP16, 80, 14, 2, 8, 2048),
    "decode fp16 d64 mha": lambda: decode_case(FP16, 64, 16, 16, 4, 1024),
    "decode fp32 d128 gqa4": lambda: decode_case(FP32, 128, 32, 8, 2, 1024),
    "decode fp32 d256 gqa2": lambda: decode_case(FP32, 256, 16, 8, 2, 1024),
    "prefill bf16 d128 gqa4": lambda: prefill_case(BF16, 128, 32, 8, 8, 2048),
    "prefill bf16 d128 gqa4 decodes": lambda: prefill_case(BF16, 128, 32, 8, 64, 1),
    "prefill bf16 d256 gqa2": lambda: prefill_case(BF16, 256, 16, 8, 2, 512),
    "prefill fp16 d80 gqa7": lambda: prefill_case(FP16, 80, 14, 2, 2, 512),
    "prefill fp16 d64 mha": lambda: prefill_case(FP16, 64, 16, 16, 2, 512),
    "prefill fp32 d128 gqa4": lambda: prefill_case(FP32, 128, 32, 8, 2, 512),
    "prefill fp32 d256 gqa2": lambda: prefill_case(FP32, 256, 16, 8, 2, 512),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90_without_spills(case, monkeypatch):
    launches: list = []
    for name in KERNELS:
        monkeypatch.setattr(tk, name, Captured(getattr(tk, name), launches))
    monkeypatch.setattr(tk, "_num_sms", lambda device: 132)  # an H200
    CASES[case]()
    assert launches
    for fn, args, kwargs in launches:
        kernel = compile_for_sm90(fn, args, kwargs)
        stack = stack_bytes(kernel)
        assert stack in (0, None), f"{fn.__name__} spills {stack} bytes of registers"


def variant(fn, args, kwargs) -> str:
    """What Triton compiles a launch for (its cache key, less the device and source):
    the kernel, its arguments' specialization and constants, and the options."""
    _, specialization, options = bind(fn, args, kwargs)
    return f"{fn.__name__} {specialization} {sorted(options.items())}"


MODELS = {  # dtype, query heads, KV heads, head dim
    "llama3-8b": (BF16, 32, 8, 128),
    "qwen3-0.6b": (BF16, 16, 8, 128),
    "gemma-like d256": (BF16, 16, 8, 256),
    "fp16 d80 gqa7": (FP16, 14, 2, 80),
    "fp32 d64": (FP32, 8, 8, 64),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_warm_up_compiles_every_variant_a_run_launches(model, monkeypatch):
    # A run's steps launch the kernels at every batch size, context and block-table
    # width; any launch that Triton would compile for anew stalls that step for a
    # second or more on a GPU. Every such launch must reuse one of the few variants
    # that warm_up compiles before the run.
    dtype, heads, kv_heads, head_dim = MODELS[model]
    launches: list = []
    for name in KERNELS:
        monkeypatch.setattr(tk, name, Captured(getattr(tk, name), launches))
    monkeypatch.setattr(tk, "_num_sms", lambda device: 132)  # an H200
    kc, vc = caches(kv_heads, head_dim, dtype)
    tk.warm_up(kc, vc, heads)
    warmed = {variant(*launch) for launch in launches}
    assert len(warmed) <= 11  # write, decode unsplit and split, 6 reduce widths, 2 prefills
    launches.clear()
    for tokens in (1, 2, 16, 17, 2048):
        key = torch.zeros(tokens, kv_heads, head_dim, dtype=dtype)
        tk.reshape_and_cache(key, key, kc, vc, torch.zeros(tokens).long())
    for batch in (1, 2, 3, 8, 16, 17, 64, 100, 256):
        query = torch.zeros(batch, heads, head_dim, dtype=dtype)
        lens = torch.ones(batch, dtype=torch.int32)
        for context in (1, 16, 17, 129, 1000, 2048, 4097, 8192, 32768):
            for width in {1, 16, 17, -(-context // 16)}:
                tables = torch.zeros(batch, width, dtype=torch.int32)
                tk.paged_attention_decode(query, kc, vc, tables, lens, 0.1, max_context_len=context)
    for num_seqs in (1, 2, 16, 17, 64):
        for first in (1, 2, 16, 100):  # one sequence's chunk, the others decode
            q_lens = [first] + [1] * (num_seqs - 1)
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            query = torch.zeros(sum(q_lens), heads, head_dim, dtype=dtype)
            lens = torch.tensor(q_lens, dtype=torch.int32) + 5
            for width in (1, 16, 17):
                tables = torch.zeros(num_seqs, width, dtype=torch.int32)
                tk.paged_attention_prefill(query, kc, vc, tables, starts, lens, 0.1)
    ran = {variant(*launch) for launch in launches}
    assert ran - warmed == set()
    assert len(ran) >= 9  # the sweep reached the split decodes and both prefill tilings
