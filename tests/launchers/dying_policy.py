"""A policy whose process dies the first times it is made: a Ray worker killed mid-job."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from policies.fcfs import FCFS


class DiesAtFirst(FCFS):
    """FCFS whose first ``deaths`` instances kill their own process (SIGKILL), each
    counting itself in the file ``marker`` first; the later ones run as FCFS."""

    def __init__(self, marker: str, deaths: int = 1, victim: str | None = None) -> None:
        super().__init__(victim)
        path = Path(marker)
        died = len(path.read_text().splitlines()) if path.exists() else 0
        if died < deaths:
            with path.open("a") as f:
                f.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
