"""testbed/signals.py: the first SIGTERM raises Terminated and is remembered until
the handler is installed again, so that a caller can tell a SIGTERM that code
wrapped in an error of its own (Hydra composing a job's config) from a failure."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from testbed.signals import Terminated, exit_status, interrupt_on_sigterm, sigterm_received

posix = pytest.mark.skipif(sys.platform == "win32", reason="sends itself SIGTERM")


@posix
def test_a_sigterm_raises_terminated_and_is_remembered_until_reinstalled():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_sigterm()
        assert not sigterm_received()
        with pytest.raises(Terminated) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
        assert sigterm_received() and exit_status(caught.value) == 143
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second one kills
        interrupt_on_sigterm()
        assert not sigterm_received()
    finally:
        signal.signal(signal.SIGTERM, previous)
