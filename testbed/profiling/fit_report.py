"""What the latency model's fit to a profile says of the profile, and what the
profile's probe says of the machine's speed while it was measured."""

from __future__ import annotations

from pathlib import Path

from testbed.profile_table import profile_speed_moved, read_profile_header
from testbed.profiling.steadiness import SPEED_MOVED_WARN, speed_line
from testbed.sim.profile_model import ProfileModel

# The latency model's median relative error on the table it was fitted to, over
# which a profile's points contradict each other (as when the machine's speed
# moved while it was measured; docs/fidelity.md).
FIT_WARN = 0.05


def fit_line(err: float, moved: float | None = None) -> str:
    """What a latency model's fit to its profile (median relative error) says, with
    a warning when it is over :data:`FIT_WARN`; with ``moved`` (the profile's
    ``speed_moved``), also what its probe saw of the machine's speed, named as the
    likely cause of a poor fit where it moved (:func:`speed_line`)."""
    line = f"latency model fitted to its profile: median relative error {err:.1%}"
    if err <= FIT_WARN:
        return line if moved is None else f"{line}\n{speed_line(moved)}"
    line += f"\nWARNING: over {FIT_WARN:.0%}: the profile's points disagree with each other"
    if moved is None:  # a profile whose header does not say
        return line + (
            ", as when the machine's speed moves while it is measured; simulations from it "
            "will be off by as much. Profile again when the machine is steadier."
        )
    line += "; simulations from it will be off by as much."
    if moved > SPEED_MOVED_WARN:
        return f"{line} The likely cause is the machine's speed:\n{speed_line(moved)}"
    return (
        f"{line} Its probe saw no move of the machine's speed to explain it: look also at "
        "load on the engine's cores between the probe's samples, and at steps the latency "
        f"model's terms do not describe.\n{speed_line(moved)}"
    )


def fit_check(path: str | Path) -> tuple[float, str]:
    """The latency model's fit to a profile table, and :func:`fit_line` with the
    table's ``speed_moved`` (none in tables measured before it)."""
    err = ProfileModel(path).fit_rel_error
    return err, fit_line(err, profile_speed_moved(read_profile_header(Path(path))))


def report_profile(path: str | Path) -> float:
    """Print where the profile was written, the latency model's fit to it (with
    the warning over :data:`FIT_WARN`) and whether the machine's speed moved while
    it was measured (a warning over :data:`SPEED_MOVED_WARN`); returns the fit."""
    fit, line = fit_check(path)
    print(f"wrote {path}")
    print(line)
    return fit
