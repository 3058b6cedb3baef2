"""SIGTERM ends a run as Ctrl-C does: with what it measured written.

``timeout``, ``kill`` and batch schedulers (SLURM, Kubernetes) stop a process
with SIGTERM, which Python does not turn into an exception: without this, a real
run, a profile or an experiment stopped that way would die without writing its
files. The entry points (``run.py``, ``python -m testbed.profiling``,
``python -m experiments.fidelity``) install the handler; a second SIGTERM kills at once.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


def interrupt_on_sigterm() -> None:
    """From now on the first SIGTERM raises KeyboardInterrupt in the main thread."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


@contextmanager
def ended_by_interrupts() -> Iterator[None]:
    """Within it, SIGTERM is an interrupt, and an interrupt that reaches its end
    (after the work has written what it measured) ends the program with the
    message "interrupted" (exit status 1) instead of a traceback."""
    interrupt_on_sigterm()
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit("interrupted") from None
