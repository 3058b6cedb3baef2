"""Self set-up for the project's two commands (standard library only).

``python run.py ...`` and ``python -m tests`` call :func:`ensure` first. When the
interpreter already has every dependency it returns at once (a user's own
environment). Otherwise it creates ``.venv`` beside the project, installs the
dependencies declared in ``pyproject.toml`` (with its ``dev`` and ``ray`` extras)
and re-executes the command inside that environment. torch is installed first and on purpose:

* on a machine without an NVIDIA GPU, the pinned CPU build (``torch==2.13.0``),
  which these machines hold on local disk, so set-up takes seconds;
* on a machine with an NVIDIA GPU, the newest release that pip picks, which on
  Linux is a CUDA build.

The other dependencies then find torch already satisfied and fetch nothing more
for it. Last, the project itself is installed into ``.venv`` in editable mode
(``pip install --no-deps -e .``, a second or two), so that scripts anywhere in
the checkout (``.venv/bin/python experiments/...``, ``benchmarks/...``) import
it without touching ``sys.path``. Set ``TESTBED_NO_BOOTSTRAP=1`` to skip all of
this.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
CPU_TORCH = "torch==2.13.0"
BUILD_BACKEND = "setuptools>=68"  # pyproject.toml's [build-system], for the editable install
# Import names that must be present for the project to run (and to test).
REQUIRED_MODULES = (
    "torch",
    "numpy",
    "pandas",
    "simpy",
    "hydra",
    "omegaconf",
    "safetensors",
    "transformers",
    "matplotlib",
    "tqdm",
    "wandb",
)
TEST_MODULES = ("pytest", "xdist", "hypothesis")


def has_nvidia_gpu() -> bool:
    """True when this machine has an NVIDIA driver (a CUDA build of torch is useful)."""
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _venv_python() -> Path:
    sub = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    return VENV / sub


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [r for r in project["dependencies"] if not r.startswith("torch")]
    extras = project["optional-dependencies"]
    # the tests' tools, and Ray: its launcher's tests run sweeps on a cluster of this machine
    return reqs + extras["dev"] + extras["ray"]


def _project_installed() -> bool:
    """True when this interpreter imports the project from this checkout as an
    installed (editable) distribution. Every distribution of that name is looked
    at: a stray ``*.egg-info`` in the checkout (on ``sys.path`` as the script's
    folder) is found first and names no install."""
    want = ROOT.resolve().as_uri()
    return any(
        json.loads(dist.read_text("direct_url.json") or "{}").get("url") == want
        for dist in importlib.metadata.distributions(name=_project_name())
    )


def _project_name() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]


def _install_project(py: Path) -> None:
    """The project into ``py``'s environment, editable and without its
    dependencies (already there); built with the environment's setuptools."""
    print(f"[bootstrap] installing the project into {VENV.name}/ (editable) ...", flush=True)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.check_call([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)])


def _stamp() -> str:
    text = (ROOT / "pyproject.toml").read_bytes() + Path(__file__).read_bytes()
    return hashlib.sha256(text).hexdigest()


def _install(py: Path) -> None:
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    torch_req = CPU_TORCH if not has_nvidia_gpu() else "torch>=2.4"
    print(f"[bootstrap] installing {torch_req} into {VENV.name}/ ...", flush=True)
    subprocess.check_call([*pip, torch_req])
    print("[bootstrap] installing the other dependencies ...", flush=True)
    subprocess.check_call([*pip, *_requirements(), BUILD_BACKEND])
    _install_project(py)


def ensure(reexec_args: list[str], with_dev: bool = False) -> None:
    """Make sure the dependencies are importable, else set up ``.venv`` and re-exec.

    ``reexec_args`` are the arguments after the interpreter for the re-exec
    (e.g. ``["run.py", *sys.argv[1:]]`` or ``["-m", "tests", ...]``). The
    environment it creates always holds the dev extras too, so that both
    commands share it; ``with_dev`` only says whether they are required here.
    """
    if os.environ.get("TESTBED_NO_BOOTSTRAP"):
        return
    wanted = REQUIRED_MODULES + (TEST_MODULES if with_dev else ())
    in_venv = Path(sys.prefix).resolve() == VENV.resolve()
    stamp_file = VENV / ".testbed-stamp"
    stamp = _stamp()
    if in_venv:
        if stamp_file.exists() and stamp_file.read_text() == stamp:
            if not _project_installed():
                _install_project(Path(sys.executable))
            return
    elif not _missing(wanted):
        return
    py = _venv_python()
    if not py.exists():
        print(f"[bootstrap] creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    if not stamp_file.exists() or stamp_file.read_text() != stamp:
        _install(py)
        stamp_file.write_text(stamp)
    if in_venv:
        return
    os.execv(str(py), [str(py), *reexec_args])
