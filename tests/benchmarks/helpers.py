"""What the benchmark scripts' tests share: a script run to its end, and one
stopped as Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


def run_script(script: Path, tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    """``python script *args --out tmp_path/out.json`` in the project's root, which
    must succeed; what it wrote, with its stdout under ``"stdout"``."""
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"stdout": proc.stdout, **json.loads(out.read_text())}
