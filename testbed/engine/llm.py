"""The offline API in the convention users know from vLLM::

    from testbed import LLM, SamplingParams
    llm = LLM(model="dummy-llama", max_num_seqs=32)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].token_ids

``model`` is an HF folder (config.json + model.safetensors, tokenizer optional) or
the name of a model config in ``conf/model/`` (its shape with seeded dummy
weights, or its ``path``). With ``speculative_config``, :meth:`LLM.get_metrics`
says how many drafts were accepted, as vLLM's ``get_metrics`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from testbed.core import Request, SamplingParams
from testbed.core.spec_stats import SpecDecodingStats
from testbed.engine.args import EngineArgs
from testbed.engine.factory import build_engine, engine_model


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None


class LLM:
    """Offline generation on the real engine (the same scheduler as everywhere)."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        self.args = EngineArgs(model=model, **engine_options)
        resolved = engine_model(model)
        self.engine, self.executor, self.config = build_engine(self.args, model=resolved)
        self.tokenizer = _load_tokenizer(resolved[1])
        self._counter = 0

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        eos = self.config.eos_token_ids[0] if self.config.eos_token_ids else None
        reqs = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = self._encode(prompt)
            p = SamplingParams(**{k: getattr(p, k) for k in p.__slots__})  # private copy
            if len(self.config.eos_token_ids) > 1:
                p.stop_token_ids = tuple(set(p.stop_token_ids) | set(self.config.eos_token_ids[1:]))
            req = Request(
                request_id=f"gen-{self._counter}",
                prompt_token_ids=ids,
                sampling_params=p,
                eos_token_id=eos,
                arrival_time=self.engine.clock(),
            )
            self._counter += 1
            self.engine.add_request(req)
            reqs.append(req)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [self._output(r) for r in reqs]

    @property
    def spec_stats(self) -> SpecDecodingStats:
        """Speculative decoding's counts since this LLM was made, over every
        :meth:`generate` call (a copy: later calls do not change it); its
        ``table()`` is the simulator's acceptance table (``spec_acceptance.csv``)."""
        return SpecDecodingStats.merged([self.engine.scheduler.spec_stats])

    def get_metrics(self) -> dict[str, Any]:
        """Speculative decoding's acceptance since this LLM was made, over every
        :meth:`generate` call, named as in a run's ``metrics.json``: drafts
        verified (``spec_num_drafts``), their draft tokens and the accepted ones,
        accepted tokens per draft position (vLLM's
        ``spec_decode_num_accepted_tokens_per_pos``), the acceptance rate
        (accepted / draft tokens), the mean acceptance length (1 + accepted /
        drafts: tokens a verification yields) and the acceptance rate per
        position (accepted there / drafts with a token there). All zero without
        speculation."""
        stats = self.spec_stats
        return {
            **stats.metrics(),
            "spec_num_accepted_tokens_per_pos": list(stats.accepted_per_pos)
            + [0] * (len(stats.drafted_per_pos) - len(stats.accepted_per_pos)),
        }

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.args.model!r} has no tokenizer: give token ids")
            return list(self.tokenizer.encode(prompt))
        return token_ids(prompt)

    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(
            r.request_id,
            list(r.prompt_token_ids or []),
            list(r.output_token_ids),
            r.finish_reason or r.reject_reason,
            text,
        )


def token_ids(prompt: Sequence[int]) -> list[int]:
    """A prompt's token ids, which must be integers (a float or a string is refused,
    not truncated or parsed)."""
    ids = list(prompt)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise TypeError(
                f"prompt token {i} is {t!r} ({type(t).__name__}): token ids must be integers "
                "(or give the prompt as a string, for a model with a tokenizer)"
            )
    return [int(t) for t in ids]


def _load_tokenizer(folder: Path | None):
    """The model folder's tokenizer (local files only), or None (dummy weights, or
    a folder without tokenizer.json)."""
    if folder is None or not (folder / "tokenizer.json").exists():
        return None
    path = folder
    from tokenizers import Tokenizer

    return _Tokenizer(Tokenizer.from_file(str(path / "tokenizer.json")))


class _Tokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
