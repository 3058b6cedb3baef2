"""What the benchmark scripts' tests share: a script stopped as Ctrl-C stops it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interrupt_after(cmd: list[str], marker: str, env: dict) -> tuple[int, str]:
    """Runs ``cmd`` in the project's root and sends it SIGINT once a line of its
    output holds ``marker``; its exit status and what it printed after that line."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell's background job inherits SIGINT ignored, and so would the script
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in proc.stdout:
        if marker in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stdout.read()
    return proc.wait(timeout=120), rest
