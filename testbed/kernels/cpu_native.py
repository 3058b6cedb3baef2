"""The C++ paged-attention kernel for short queries on a CPU
(``cpu_paged_attention.cpp``), a decoder layer's fused elementwise ops
(``cpu_layer_ops.cpp``), linear products for a few rows
(``cpu_linear_rows.cpp``) and a whole decoder layer in one call
(``cpu_decoder_layer.cpp``), compiled on first use and loaded as torch ops.

It reads K/V through the block table (no gathered copy, no padding) for every
query of a few rows in one call: decodes, speculative verifications, short
prompts. The first use on a machine compiles it (about 10 s; torch caches the
build under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``,
one per CPU feature set, and rebuilds when the source changes). Where it cannot
be built (no C++ compiler, or no ninja: the ``ninja`` package provides one),
:func:`kernel` returns None and says why once, and
``testbed.kernels.cpu_attention`` runs those queries through its torch path.
``TESTBED_CPU_KERNEL=torch`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from testbed.host import cpu_fields

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_paged_attention.cpp",
        "cpu_layer_ops.cpp",
        "cpu_linear_rows.cpp",
        "cpu_decoder_layer.cpp",
    )
]
HEADERS = [Path(__file__).with_name(n) for n in ("cpu_vec.h", "cpu_ops.h")]


def _build_name() -> str:
    """The build's name: one per CPU feature set, since ``-march=native`` code may
    not run on another CPU and torch's build cache (often a home folder that
    machines share) is keyed on the name and the sources only; the headers the
    sources include are in the name too, since torch does not see them."""
    fields = cpu_fields()
    flags = (
        fields.get("flags") or fields.get("Features") or platform.processor() or platform.machine()
    )
    key = flags.encode() + b"".join(h.read_bytes() for h in HEADERS)
    return f"testbed_cpu_{hashlib.sha1(key).hexdigest()[:10]}"


_reason: str | None = None  # why the kernel is not available (None: it is, or not tried)


def enabled() -> bool:
    """Whether the kernel may be used (``TESTBED_CPU_KERNEL`` is not ``torch``)."""
    return os.environ.get("TESTBED_CPU_KERNEL", "native").strip().lower() != "torch"


def _ninja_on_path() -> None:
    """torch builds with the ``ninja`` on PATH: where there is none, the one the
    ``ninja`` package installed beside this interpreter (not on PATH when the
    environment is not activated)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@functools.cache
def _build() -> Callable | None:
    global _reason
    from torch.utils import cpp_extension

    _ninja_on_path()
    try:
        cpp_extension.load(
            name=_build_name(),
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],  # the libgomp torch loaded: its threads
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _reason = f"the C++ CPU attention kernel could not be built ({first_line})"
        warnings.warn(
            f"{_reason}; running short queries through the torch path instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return torch.ops.testbed_cpu.paged_attention_rows


def kernel() -> Callable | None:
    """``paged_attention_rows(out, query, key_cache, value_cache, block_tables,
    items, scale)``, or None where it is turned off or cannot be built."""
    return _build() if enabled() else None


def layer_ops():
    """``torch.ops.testbed_cpu`` with ``rms_norm``, ``silu_and_mul`` and ``rotary``
    (``cpu_layer_ops.cpp``), or None where the build is turned off or failed."""
    return torch.ops.testbed_cpu if kernel() is not None else None


def unavailable_reason() -> str | None:
    """Why :func:`kernel` returns None (None where it does not, or has not been asked)."""
    if not enabled():
        return "turned off (TESTBED_CPU_KERNEL=torch)"
    return _reason
