"""Scheduling policies, one short file each, and the registry that finds them.

Select one by name (``policy=fcfs``), by a dotted path to your own class
(``policy.name=mypkg.mymod:MyPolicy``) or by a Hydra-style ``_target_``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from testbed.core.policy import Policy

REGISTRY: dict[str, str] = {
    "fcfs": "policies.fcfs:FCFS",
    "priority": "policies.priority:Priority",
    "sjf": "policies.sjf:SJF",
    "srpt": "policies.srpt:SRPT",
    "cache_aware_sjf": "policies.cache_aware_sjf:CacheAwareSJF",
    "edf": "policies.edf:EDF",
    "vtc": "policies.vtc:VTC",
    "mlfq": "policies.mlfq:MLFQ",
}


def import_class(path: str, base: type, what: str) -> type:
    """The class at ``module:Class`` (or ``module.Class``), a subclass of ``base``
    (``what`` names the kind in errors)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import {what} class {path!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{path!r} is not a subclass of testbed.core.{base.__name__}")
    return cls


def is_class_path(name: str) -> bool:
    """Whether ``name`` is a dotted path to a class rather than a bundled name."""
    return "." in name or ":" in name


def policy_class(path: str) -> type[Policy]:
    """The policy class at ``module:Class`` (or ``module.Class``)."""
    return import_class(path, Policy, "policy")


def make_policy(spec: str | Mapping[str, Any] | Policy, **kwargs: Any) -> Policy:
    """Build a policy from a name, a ``module:Class`` path, or a config mapping.

    A mapping holds ``name`` (or ``_target_``) plus the constructor's arguments.
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping):
        args = {k: v for k, v in spec.items() if k not in ("name", "_target_")}
        target = spec.get("_target_") or spec.get("name")
        if target is None:
            raise ValueError(f"policy config needs 'name' or '_target_': {dict(spec)}")
        return make_policy(target, **args, **kwargs)
    path = REGISTRY.get(spec, spec)
    if path == spec and ":" not in spec and "." not in spec:
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(sorted(REGISTRY))}")
    return policy_class(path)(**kwargs)


__all__ = ["REGISTRY", "make_policy", "policy_class"]
