"""Runs the replay tool's ``vllm_steps.main`` with per-request data, and optionally
with a testbed policy inside vLLM's scheduler.

Usage (with the replay venv's python):
``vllm_shim.py TOOL_DIR [--testbed-policy=JSON [--scheduler-cls=QUALNAME]
[--testbed-forget-uncomputed=1]] [vllm_steps args]``.

The tool gives every request priority 0; a ``priority`` column of the stream
CSV (lower first, as in vLLM) is set on each vLLM ``Request`` as it is made, and
the columns ``tenant``, ``ttft_slo_s``, ``tpot_slo_s``, ``target_output_tokens``
and ``predicted_output_tokens`` go to its ``SamplingParams.extra_args["testbed"]``.

With ``--testbed-policy`` (a ``policies.make_policy`` mapping, as JSON) the tool
builds ``--scheduler-cls`` (default
``testbed.vllm_backend.scheduler.PolicyScheduler``) in place of vLLM's
scheduler, with the spec in ``additional_config`` and the replay's clock: the
policy's ``now`` is the step index, as on our side (``ours.py``). With
``--testbed-forget-uncomputed=1`` the class unfinds the blocks a victim
preempted after its scheduling in the same step had cached, as our KV manager does. The project
root must be on ``PYTHONPATH``. vLLM and the tool are not modified.
"""

import csv
import json
import sys

EXTRA_COLUMNS = {
    "tenant": str,
    "ttft_slo_s": float,
    "tpot_slo_s": float,
    "target_output_tokens": int,
    "predicted_output_tokens": int,
}
DEFAULT_CLASS = "testbed.vllm_backend.scheduler.PolicyScheduler"


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of ``--name=VALUE`` in ``argv`` and ``argv`` without it."""
    flag = f"--{name}="
    found = [a for a in argv if a.startswith(flag)]
    return (found[-1][len(flag) :] if found else None), [a for a in argv if not a.startswith(flag)]


def _replay_class(qualname: str, spec: dict, arrival_step: dict[str, int], forget: bool) -> type:
    """The scheduler class with ``spec`` in its config and the step index as clock."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from testbed.vllm_backend.support import FORGET_KEY, POLICY_KEY

    base = resolve_obj_by_qualname(qualname)

    class ReplayScheduler(base):
        def __init__(self, vllm_config, *args, **kwargs):
            # The step about to run: the next one, or an arrival's after an idle spell.
            self._replay_step = 0
            extra = dict(vllm_config.additional_config or {})
            extra[POLICY_KEY] = spec
            extra[FORGET_KEY] = forget
            vllm_config.additional_config = extra
            super().__init__(vllm_config, *args, **kwargs)

        def tb_now(self) -> float:
            return float(self._replay_step)

        def add_request(self, request):
            self._replay_step = max(self._replay_step, arrival_step.get(request.request_id, 0))
            super().add_request(request)

        def update_from_output(self, scheduler_output, model_runner_output):
            out = super().update_from_output(scheduler_output, model_runner_output)
            self._replay_step += 1
            return out

    ReplayScheduler.__name__ = ReplayScheduler.__qualname__ = f"Replay{base.__name__}"
    return ReplayScheduler


def main() -> int:
    tool_dir, argv = sys.argv[1], sys.argv[2:]
    spec_json, argv = _option(argv, "testbed-policy")
    qualname, argv = _option(argv, "scheduler-cls")
    forget, argv = _option(argv, "testbed-forget-uncomputed")
    sys.path.insert(0, tool_dir)
    import vllm_steps

    stream, _ = _option(argv, "requests")
    with open(stream, newline="") as f:
        rows = list(csv.DictReader(f))
    priorities, extras = {}, {}
    for i, row in enumerate(rows):
        rid = (row.get("request_id") or str(i)).strip()
        if row.get("priority") not in (None, ""):
            priorities[rid] = int(row["priority"])
        given = {
            k: kind(row[k]) for k, kind in EXTRA_COLUMNS.items() if row.get(k) not in (None, "")
        }
        if given:
            extras[rid] = given
    if priorities or extras:
        from vllm.v1.request import Request

        made = Request.__init__

        def with_data(self, *args, **kwargs):
            made(self, *args, **kwargs)
            self.priority = priorities.get(self.request_id, 0)
            data = extras.get(self.request_id)
            if data:
                sp = self.sampling_params
                sp.extra_args = {**(sp.extra_args or {}), "testbed": data}

        Request.__init__ = with_data
    if spec_json is not None:
        from vllm.config import SchedulerConfig

        step_time, _ = _option(argv, "step-time-s")
        reqs = vllm_steps.load_requests(stream, float(step_time) if step_time else None)
        cls = _replay_class(
            qualname or DEFAULT_CLASS,
            json.loads(spec_json),
            {r.rid: r.arrival_step for r in reqs},
            forget == "1",
        )
        SchedulerConfig.get_scheduler_cls = lambda self: cls
    return vllm_steps.main(argv)


if __name__ == "__main__":
    sys.exit(main())
