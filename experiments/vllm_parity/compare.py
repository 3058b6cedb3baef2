"""Two per-step tables (the replay tool's columns) compared step by step.

A step is identical when both sides ran it (same step index) and scheduled the
same tokens for the same requests in the same order, admitted and resumed the
same requests with the same prefix hits, preempted and finished the same
requests, and ended with the same running and waiting counts and KV usage.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

# Compared as written (order matters: it is the batch's order) ...
ORDERED = ["num_running", "num_waiting", "kv_usage", "scheduled", "admitted", "resumed"]
# ... and as sets (each side lists them in its own order).
UNORDERED = ["preempted", "finished"]
FIELDS = ORDERED + UNORDERED


def read_steps(path: Path) -> dict[int, dict[str, str]]:
    with open(path, newline="") as f:
        return {int(row["step"]): row for row in csv.DictReader(f)}


def differences(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The fields in which one step differs between the sides."""
    out = [name for name in ORDERED if ours[name] != theirs[name]]
    for name in UNORDERED:
        if set(filter(None, ours[name].split(";"))) != set(filter(None, theirs[name].split(";"))):
            out.append(name)
    return out


@dataclass
class Comparison:
    steps_ours: int
    steps_vllm: int
    identical: int  # steps both ran and that match in every field
    first_divergence: int | None  # step index, None when every step matches
    first_fields: list[str] = field(default_factory=list)
    rows: tuple[dict | None, dict | None] = (None, None)  # (ours, vLLM) at the divergence
    differing: dict[str, int] = field(default_factory=dict)  # steps differing per field

    @property
    def same(self) -> bool:
        return self.first_divergence is None

    def summary(self) -> str:
        head = (
            f"{self.identical} of {self.steps_vllm} vLLM steps identical "
            f"(ours ran {self.steps_ours})"
        )
        if self.same:
            return head + ": every step identical"
        lines = [head, f"first divergence at step {self.first_divergence}: {self.first_fields}"]
        ours, theirs = self.rows
        for name in ["step", *FIELDS]:
            a = "(no such step)" if ours is None else ours.get(name, "")
            b = "(no such step)" if theirs is None else theirs.get(name, "")
            mark = "  " if a == b else "≠ "
            lines.append(f"  {mark}{name:<14} ours: {a}")
            lines.append(f"    {'':<14} vLLM: {b}")
        if self.differing:
            counts = ", ".join(f"{k} {v}" for k, v in self.differing.items())
            lines.append(f"steps differing, by field: {counts}")
        return "\n".join(lines)


def compare(ours_csv: Path, vllm_csv: Path) -> Comparison:
    ours, theirs = read_steps(ours_csv), read_steps(vllm_csv)
    result = Comparison(len(ours), len(theirs), 0, None)
    for step in sorted(set(ours) | set(theirs)):
        a, b = ours.get(step), theirs.get(step)
        diff = ["step"] if a is None or b is None else differences(a, b)
        for name in diff:
            result.differing[name] = result.differing.get(name, 0) + 1
        if not diff:
            result.identical += 1
        elif result.first_divergence is None:
            result.first_divergence, result.first_fields, result.rows = step, diff, (a, b)
    return result
