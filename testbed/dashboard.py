"""Write a sweep's ``dashboard.html`` (``testbed/report/dashboard.py``):

    python -m testbed.dashboard <sweep or results folder> [--out FILE] [--title T]

A multirun writes one at its end; this rebuilds it, or makes one for any folder
of run folders (e.g. an experiment's ``outputs/...``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.report.dashboard import write_dashboard


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a sweep folder, or any folder of run folders")
    ap.add_argument("--out", type=Path, help="where to write it (default: <folder>/dashboard.html)")
    ap.add_argument("--title", help="the page's title (default: the folder's name)")
    a = ap.parse_args(argv)
    if not a.folder.is_dir():
        print(f"Error: {a.folder}: not a folder", file=sys.stderr)
        return 2
    try:
        out = write_dashboard(a.folder, a.out, a.title)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
