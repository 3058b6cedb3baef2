"""A run's W&B logging, in a process of its own, started when a simulation starts
(a real run starts it after its last step: ``testbed/job.py``).

W&B's import and ``init`` take about a second (most of it waiting for W&B's
service process to come up). In a thread of the run's own process they slow a
simulation by more than that (the two contend for the interpreter lock); in a
child process they overlap it on another core. The child starts the W&B run at
once, then waits for one line on its stdin: ``{"log": ...}`` once the run
directory is written (it logs it, ``testbed.report.wandb_log.log_run``) or
``{"abandon": ...}`` (it finishes the W&B run as failed); the end of its input
without either, as when the run's process was killed, is an abandon too. It
answers one JSON line (the W&B run folder, or the error) and exits.

    python -m testbed.report.wandb_process   # the child; started by WandbProcess
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TIMEOUT_S = 300  # for the child to log and exit, once asked


class WandbProcess:
    """The parent's side: starts the child with the W&B run's settings; ``log``
    hands it the written run directory and waits for it."""

    def __init__(self, wandb_cfg: Mapping[str, Any], run_dir: Path, name: str, config: dict):
        self.wandb_cfg = dict(wandb_cfg)
        self.proc: subprocess.Popen | None = None
        if self.wandb_cfg.get("mode", "offline") == "disabled":
            return
        start = dict(wandb_cfg=self.wandb_cfg, run_dir=str(run_dir), name=name, config=config)
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in _finish)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.report.wandb_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # a Ctrl-C meant for the run is the run's to handle
            env={**os.environ, "WANDB_SILENT": os.environ.get("WANDB_SILENT", "true")},
        )
        self._send({"start": start})

    def _send(self, message: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message, default=str) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # the child has died: its error is read at the end
            pass

    def _finish(self, message: dict) -> dict[str, Any]:
        if self.proc is None:
            return {}
        self._send(message)
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self._stderr.seek(0)
        err = self._stderr.read()
        self._stderr.close()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        answer = json.loads(lines[-1]) if lines else {}
        if self.proc.returncode != 0 or "error" in answer:
            why = answer.get("error") or err.strip().splitlines()[-1:] or ["no answer"]
            answer["error"] = why if isinstance(why, str) else why[0]
        return answer

    def log(self, run_dir: Path, plots: list[Path]) -> str | None:
        """Have the child log ``run_dir``; the W&B run folder (None where W&B is
        disabled). W&B failing does not fail the run: it is reported."""
        message = {"run_dir": str(run_dir), "plots": [str(p) for p in plots]}
        answer = self._finish({"log": message})
        if answer.get("error"):
            print(f"  WARNING: W&B logging failed: {answer['error']}")
            return None
        return answer.get("wandb_dir")

    def abandon(self, reason: str) -> None:
        """Finish the W&B run unlogged (the run failed before its report)."""
        self._finish({"abandon": reason})


def child() -> int:
    """The child's side (the module docstring)."""
    from testbed.report.wandb_log import PROJECT, log_run, start

    line = sys.stdin.readline()
    if not line:
        return 0  # the run's process went before saying what to log
    setup = json.loads(line)["start"]
    wb = setup["wandb_cfg"]
    run = None
    try:
        run = start(
            wb.get("mode", "offline"),
            Path(wb.get("dir") or setup["run_dir"]),
            project=wb.get("project") or PROJECT,
            entity=wb.get("entity"),
            group=wb.get("group"),
            tags=list(wb.get("tags") or []),
            name=setup["name"],
            config=setup["config"],
        )
        order = sys.stdin.readline()
        task = json.loads(order) if order.strip() else {"abandon": "the run's process ended"}
        if "log" not in task:
            run.finish(exit_code=1)
            print(json.dumps({"abandoned": task.get("abandon")}))
            return 0
        job = task["log"]
        plots = [Path(p) for p in job["plots"]]
        folder = log_run(run, Path(job["run_dir"]), plots, int(wb.get("table_rows") or 0))
        run.finish()
        print(json.dumps({"wandb_dir": folder}))
        return 0
    except Exception as e:
        if run is not None:
            run.finish(exit_code=1)
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1


if __name__ == "__main__":
    sys.exit(child())
