"""glibc's malloc set to keep what a CPU engine frees (``keep_freed_memory``).

By default glibc gives memory back to the OS when the top of its heap holds more
free bytes than a threshold, and serves large blocks from fresh mappings. A
step's temporaries on a CPU are megabytes each (a prefill chunk of 750 tokens:
about 25 MB a layer), so every step returned them and faulted them back in,
zero-filled by the kernel, at its next allocation: about 160,000 page faults
while prefilling 40 prompts of Azure conv (22,701 tokens) on the dummy Llama,
3-4% of that time. Blocks up to 32 MB (glibc's largest setting) now come from
the heap, and the heap is not trimmed below 1 GiB; the process keeps its peak
of freed memory, as vLLM's CPU build does with the tcmalloc it preloads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 2**30


@functools.cache
def keep_freed_memory() -> str | None:
    """Set glibc's malloc to keep freed memory, once per process; None, or why it
    was left as it was (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"no glibc mallopt here ({name or 'no C library found'})"
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    if not kept:
        return "mallopt refused the thresholds"
    return None
