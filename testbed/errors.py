"""The error of a run's input: its config, trace or model is wrong.

Raised where the input is read, with a message that names the key, file, row
or field and what is allowed; ``run.py`` prints the message alone (the
traceback with ``HYDRA_FULL_ERROR=1``), as Hydra does for its own config errors.
"""


class InputError(ValueError):
    """A run's config, trace or model is wrong; the message says which and how."""
