"""What the latency model's fit to a profile says of the profile."""

from __future__ import annotations

from pathlib import Path

from testbed.sim.profile_model import ProfileModel

# The latency model's median relative error on the table it was fitted to, over
# which a profile's points contradict each other (as when the machine's speed
# moved while it was measured; docs/fidelity.md).
FIT_WARN = 0.05


def fit_line(err: float) -> str:
    """What a latency model's fit to its profile (median relative error) says, with
    a warning when it is over :data:`FIT_WARN`."""
    line = f"latency model fitted to its profile: median relative error {err:.1%}"
    if err > FIT_WARN:
        line += (
            f"\nWARNING: over {FIT_WARN:.0%}: the profile's points disagree with each other, "
            "as when the machine's speed moves while it is measured; simulations from it "
            "will be off by as much. Profile again when the machine is steadier."
        )
    return line


def fit_check(path: str | Path) -> tuple[float, str]:
    """The latency model's fit to a profile table, and :func:`fit_line`."""
    err = ProfileModel(path).fit_rel_error
    return err, fit_line(err)


def report_profile(path: str | Path) -> float:
    """Print where the profile was written and the latency model's fit to it (with
    the warning over :data:`FIT_WARN`); returns the fit."""
    fit, line = fit_check(path)
    print(f"wrote {path}")
    print(line)
    return fit
