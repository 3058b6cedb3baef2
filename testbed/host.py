"""This machine's CPU as the operating system reports it: the first processor's
``/proc/cpuinfo`` fields, and the cores this process may run on."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (``model name``, ``flags`` on
    x86, ``Features`` on ARM); empty where the file cannot be read (not Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = info.split("\n\n", 1)[0]
    pairs = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def usable_cpus() -> set[int]:
    """The cores this process may run on (its affinity where the OS says, which a
    container's cpuset or a pinned run narrows; else all the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (:func:`usable_cpus`)."""
    return len(usable_cpus())
