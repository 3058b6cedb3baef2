"""Runs the replay tool's ``vllm_steps.main`` with per-request priorities.

Usage (with the replay venv's python): ``vllm_shim.py TOOL_DIR [vllm_steps args]``.
The tool gives every request priority 0; a ``priority`` column of the stream
CSV (lower first, as in vLLM) is set on each vLLM ``Request`` as it is made.
Nothing else of vLLM or the tool is touched.
"""

import csv
import sys


def main() -> int:
    tool_dir, argv = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, tool_dir)
    import vllm_steps

    stream = next(a.split("=", 1)[1] for a in argv if a.startswith("--requests="))
    with open(stream, newline="") as f:
        rows = list(csv.DictReader(f))
    priorities = {
        (row.get("request_id") or str(i)).strip(): int(row["priority"])
        for i, row in enumerate(rows)
        if row.get("priority") not in (None, "")
    }
    if priorities:
        from vllm.v1.request import Request

        made = Request.__init__

        def with_priority(self, *args, **kwargs):
            made(self, *args, **kwargs)
            self.priority = priorities.get(self.request_id, 0)

        Request.__init__ = with_priority
    return vllm_steps.main(argv)


if __name__ == "__main__":
    sys.exit(main())
