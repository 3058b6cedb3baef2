"""``python -m testbed.vllm_backend.child JOB OUT``: one trace replay on vLLM, run in
the vLLM environment (``.venv-vllm``) by ``mode=vllm`` (``testbed/modes/vllm.py``).

``JOB`` is a pickled dict: ``engine_args`` (vLLM's), ``requests`` (testbed
requests with token ids), ``warmup`` (requests served first and not measured),
``max_wall_s``. ``OUT`` gets a pickled dict: the replay's ``RunResult``, the
vLLM version and the scheduler's summed time. Progress goes to the file
descriptor in ``TESTBED_PROGRESS_FD`` as ``<time> <done>`` lines. An interrupted
replay (SIGINT) still writes what it measured.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time

# vLLM reads these when it builds the engine: everything in this process, and the
# caller's request ids kept as they are.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")


def main(job_path: str, out_path: str) -> int:
    import torch
    import vllm

    from testbed.core import WallClock
    from testbed.engine.replay import replay
    from testbed.vllm_backend.engine import VllmEngine

    with open(job_path, "rb") as f:
        job = pickle.load(f)
    progress = _progress_writer()
    built = time.perf_counter()
    engine = VllmEngine(job["engine_args"], WallClock())
    build_s = time.perf_counter() - built
    warm = time.perf_counter()
    for req in job["warmup"]:
        engine.add_request(req)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    engine.schedule_s = 0.0
    warmup_s = time.perf_counter() - warm
    steps_before = engine._num_steps
    result = replay(engine, job["requests"], progress, job["max_wall_s"])
    if result.error is not None and not _plain(result.error):
        result.error = RuntimeError(repr(result.error))  # vLLM's classes stay here
    payload = {
        "result": result,
        "vllm_version": vllm.__version__,
        "schedule_s": engine.schedule_s,
        "num_steps": engine._num_steps - steps_before,
        "build_s": build_s,
        "warmup_s": warmup_s,
        "threads": torch.get_num_threads(),  # what vLLM left torch for serving
    }
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


def _progress_writer():
    fd = os.environ.get("TESTBED_PROGRESS_FD")
    if not fd:
        return None
    stream = os.fdopen(int(fd), "w", buffering=1)

    def report(t: float, done: int) -> None:
        with contextlib.suppress(OSError):  # the parent stopped reading: go on
            stream.write(f"{t:.6f} {done}\n")

    return report


def _plain(error: BaseException) -> bool:
    """True when the parent can unpickle ``error`` (a built-in or the project's)."""
    return type(error).__module__.split(".")[0] in ("builtins", "testbed")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
