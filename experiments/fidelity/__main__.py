"""``python -m experiments.fidelity``: see :mod:`experiments.fidelity`."""

from experiments.fidelity.cli import main

if __name__ == "__main__":
    main()
