"""SIGTERM ends a run as Ctrl-C does: with what it measured written.

``timeout``, ``kill`` and batch schedulers (SLURM, Kubernetes) stop a process
with SIGTERM, which Python does not turn into an exception: without this, a real
run, a profile or an experiment stopped that way would die without writing its
files. The entry points (``run.py``, ``python -m testbed.profiling``,
``python -m experiments.fidelity``) install the handler; a second SIGTERM kills at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that the work stops as on Ctrl-C."""


_received = False  # whether the handler has fired since it was installed


def _raise_terminated(signum, frame) -> None:
    """The handler: the first SIGTERM raises :class:`Terminated`, a second kills."""
    global _received
    _received = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated(f"signal {signal.Signals(signum).name}")


def interrupt_on_sigterm() -> None:
    """From now on the first SIGTERM raises :class:`Terminated` in the main thread."""
    global _received
    _received = False
    signal.signal(signal.SIGTERM, _raise_terminated)


def sigterm_received() -> bool:
    """Whether a SIGTERM has raised :class:`Terminated` since the handler was
    installed (:func:`interrupt_on_sigterm`, :func:`sigterm_as_interrupt`): code it
    interrupts may turn it into an error of its own (Hydra composing a job's config;
    Ray's blocking calls, a plain KeyboardInterrupt), which is then the SIGTERM's."""
    return _received


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it the first SIGTERM raises :class:`Terminated` (a second kills), the
    previous handler after; :func:`sigterm_received` says whether one came."""
    previous = signal.getsignal(signal.SIGTERM)
    interrupt_on_sigterm()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """What a shell reports for a process ended by that signal: 128 + its number
    (130 for SIGINT, 143 for SIGTERM), as batch schedulers expect."""
    signum = signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
    return 128 + int(signum)


@contextmanager
def ended_by_interrupts() -> Iterator[None]:
    """Within it, SIGTERM is an interrupt, and an interrupt that reaches its end
    (after the work has written what it measured) ends the program with the
    message "interrupted" and the signal's exit status (:func:`exit_status`)
    instead of a traceback."""
    interrupt_on_sigterm()
    try:
        yield
    except KeyboardInterrupt as e:
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(exit_status(e)) from None
