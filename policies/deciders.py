"""Disaggregation deciders: whether a request's prompt is computed on a prefill
instance and its KV moved to a decode instance, or the decode instance computes
it itself (BLIS's deciders; llm-d's selective P/D). The interface,
:class:`~testbed.core.routing.Decider`, is the core's; the cluster core
(:mod:`testbed.core.cluster`) asks it in both modes."""

from __future__ import annotations

from policies import import_class, is_class_path
from testbed.core.request import Request
from testbed.core.routing import Decider


class Always(Decider):
    name = "always"

    def disaggregate(self, request: Request, uncached_tokens: int) -> bool:
        return True


class Never(Decider):
    name = "never"

    def disaggregate(self, request: Request, uncached_tokens: int) -> bool:
        return False


class UncachedPrompt(Decider):
    """Disaggregate prompts with more than ``threshold`` uncached tokens: a short
    prefill costs a decode batch less than moving its KV does."""

    name = "uncached_prompt"
    reads_cache = True

    def __init__(self, threshold: int = 512) -> None:
        if threshold < 0:
            raise ValueError(f"uncached_prompt: threshold must be >= 0, got {threshold}")
        self.threshold = threshold

    def disaggregate(self, request: Request, uncached_tokens: int) -> bool:
        return uncached_tokens > self.threshold


DECIDERS = {cls.name: cls for cls in (Always, Never, UncachedPrompt)}


def make_decider(name: str, **kwargs) -> Decider:
    """A bundled decider by name, or your own by its class's path (``mypkg.mod:MyDecider``,
    a subclass of :class:`testbed.core.Decider`)."""
    if is_class_path(name):
        return import_class(name, Decider, "decider")(**kwargs)
    if name not in DECIDERS:
        raise ValueError(f"unknown decider {name!r}; known: {', '.join(sorted(DECIDERS))}")
    return DECIDERS[name](**kwargs)
