"""A results folder's ``manifest.json``: the code, command, machine, profile and
date that produced it, written by every experiment script into its output folder.

For a result committed before manifests existed, ``--from-history`` records the
commit that added the folder and its date from git, with the command as the
folder's README gives it (``"recorded_from": "git history"``):

    python -m experiments.manifest experiments/results/<folder> --from-history \\
        --command "python -m experiments.fidelity ..."
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str | None:
    """``git <args>`` in the project's checkout; None where git or the checkout is missing."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def cpu() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def sha1(path: Path) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def _checkout() -> tuple[str | None, bool | None]:
    """The checkout's commit, and whether tracked files differ from it."""
    status = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "HEAD"), None if status is None else bool(status)


# The code an experiment runs is what was checked out when it started (its modules
# are loaded then), not at its end, when the manifest is written.
_AT_START = _checkout()


def _shown(path: Path) -> str:
    """A profile's path as a manifest records it: relative to the checkout where it
    lies inside (no machine's folder names in a committed result), else as given."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def write_manifest(
    folder: Path,
    command: str | None = None,
    profiles: Iterable[Path] = (),
    **extra,
) -> Path:
    """``folder/manifest.json`` for a result produced by this process: the
    checkout's commit when the process started (and whether tracked files
    differed from it; the commit at the end too, where it moved), ``command``
    (default: this process's command line), the host, the sha1 of each profile
    table in ``profiles``, the date (UTC) and ``extra``."""
    sha, dirty = _AT_START
    now_sha, now_dirty = _checkout()
    moved = {}
    if (now_sha, now_dirty) != (sha, dirty):  # edited while it ran: what ran is the start's
        moved = {"git_sha_at_end": now_sha, "git_dirty_at_end": now_dirty}
    manifest = dict(
        git_sha=sha,
        git_dirty=dirty,
        **moved,
        command=command or shlex.join(sys.orig_argv),
        host=dict(name=platform.node(), cpu=cpu(), platform=platform.platform()),
        profile_sha1={_shown(p): sha1(p) for p in sorted(set(map(Path, profiles)))},
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def profiles_simulated_with(folder: Path) -> dict[str, str]:
    """The profile digests a fidelity result records (``meta.simulated_with``:
    the latency model's source, ``... sha1 <first 10 hex digits>``)."""
    path = folder / "fidelity.json"
    if not path.is_file():
        return {}
    sources = json.loads(path.read_text()).get("meta", {}).get("simulated_with", [])
    found = {}
    for source in sources:
        digest = re.search(r"sha1 ([0-9a-f]+)", source)
        if digest:
            found[source.split(" (")[0].removeprefix("profile ")] = digest.group(1)
    return found


def from_history(folder: Path, command: str, host: str | None = None, **extra) -> Path:
    """``folder/manifest.json`` for a result committed without one: the commit that
    added the folder and its date (from git), ``command`` as its README gives it,
    ``host`` as its README describes the machine, and the profiles' digests its
    ``fidelity.json`` records (the first 10 hex digits)."""
    relative = folder.resolve().relative_to(ROOT)
    added = git("log", "--diff-filter=A", "--format=%H %aI", "--", str(relative))
    if not added:
        raise SystemExit(f"{folder}: no commit in git history adds it")
    sha, date = added.splitlines()[-1].split()
    manifest = dict(
        recorded_from="git history",
        git_sha=sha,
        command=command,
        host=host,
        profile_sha1=profiles_simulated_with(folder),
        date=date,
        **extra,
    )
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--from-history", action="store_true", help="a result committed earlier")
    ap.add_argument("--command", required=True, help="the command that produced the folder")
    ap.add_argument("--host", help="the machine, as the folder's README describes it")
    ap.add_argument("--note", help="anything else a reader needs (stored as 'note')")
    args = ap.parse_args(argv)
    extra = {"note": args.note} if args.note else {}
    if args.from_history:
        path = from_history(args.folder, args.command, args.host, **extra)
    else:
        path = write_manifest(args.folder, args.command, **extra)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
