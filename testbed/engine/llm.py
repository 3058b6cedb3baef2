"""Build a real engine, and the offline API in the convention users know from vLLM::

    from testbed import LLM, SamplingParams
    llm = LLM(model="dummy-llama", max_num_seqs=32)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].token_ids

``model`` is an HF folder (config.json + model.safetensors, tokenizer optional) or
the name of a model config in ``conf/model/`` (its shape with seeded dummy
weights, or its ``path``).
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from policies import make_policy
from testbed.core import (
    EngineCore,
    KVCacheManager,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    WallClock,
)
from testbed.engine.config import ModelConfig
from testbed.engine.model import CausalLM
from testbed.engine.runner import ModelExecutor
from testbed.engine.weights import build_model
from testbed.kernels import select_backend
from testbed.models import ModelSpec, num_kv_blocks

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class EngineArgs:
    """Everything that builds one real engine instance (names as in vLLM)."""

    model: str
    policy: Any = "fcfs"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None  # on CPU, 512 MiB unless set
    gpu_memory_utilization: float = 0.9
    device: str | None = None  # default: cuda when available
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # auto | triton | torch
    threads: int | None = None  # torch's intra-op threads on CPU; default: torch's (one per core)
    cpus: Sequence[int] | None = None  # cores the process is pinned to (Linux); default: any
    seed: int = 0
    extra: dict = field(default_factory=dict)


def resolve_model(model: str) -> tuple[ModelConfig, Path | None, str]:
    """(config, weights folder or None for dummy weights, name) for a path or config name."""
    path = Path(model)
    if path.is_dir() or (path.suffix == ".json" and path.exists()):
        folder = path if path.is_dir() else path.parent
        return ModelConfig.from_path(folder), folder, folder.name
    conf = PROJECT_ROOT / "conf" / "model" / f"{model}.yaml"
    if not conf.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither an HF folder nor a config in "
            f"{conf.parent} (known: {sorted(p.stem for p in conf.parent.glob('*.yaml'))})"
        )
    spec = yaml.safe_load(conf.read_text())
    if spec.get("hf_config"):
        return ModelConfig.from_hf(spec["hf_config"], source=str(conf)), None, spec["name"]
    folder = Path(_env_interpolation(str(spec["path"])))
    folder = folder if folder.is_absolute() else PROJECT_ROOT / folder
    return ModelConfig.from_path(folder), folder, spec["name"]


def _env_interpolation(text: str) -> str:
    """Resolve ``${oc.env:VAR,default}`` as Hydra would (the engine runs without it)."""
    return re.sub(
        r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*),([^}]*)\}",
        lambda m: os.environ.get(m.group(1), m.group(2)),
        text,
    )


def models_dir() -> Path:
    """Where shared model folders live: ``$TESTBED_MODELS_DIR`` or ``../shared/models``."""
    default = PROJECT_ROOT.parent / "shared" / "models"
    return Path(os.environ.get("TESTBED_MODELS_DIR", str(default)))


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32  # CPU kernels are fast and exact in fp32
    named = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "fp32": torch.float32,
    }
    return named.get(dtype or "", torch.bfloat16)


def token_validator(vocab_size: int) -> Callable[[Request], str | None]:
    def validate(req: Request) -> str | None:
        ids = req.prompt_token_ids
        if ids is None:
            return "the real engine needs prompt token ids"
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"token id {bad} outside the vocabulary of {vocab_size}"
        return None

    return validate


def build_engine(
    args: EngineArgs,
    clock=None,
    model: tuple[ModelConfig, Path | None, str] | None = None,
    weights: CausalLM | None = None,
) -> tuple[EngineCore, ModelExecutor, ModelConfig]:
    """One real engine. ``model`` (config, weights folder, name) overrides ``args.model``;
    ``weights``, an already built model of that config, is shared instead of built
    again (with its own KV cache, scheduler and sampler)."""
    cfg, folder, name = model or resolve_model(args.model)
    device = pick_device(args.device)
    if args.threads is not None and device.type == "cpu":
        if not isinstance(args.threads, int) or args.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {args.threads!r}")
        torch.set_num_threads(args.threads)
    if args.cpus is not None:
        pin_cpus(args.cpus)
    dtype = pick_dtype(args.dtype, device)
    if device.type == "cuda":
        # An engine of an earlier run in this process (a sweep, an experiment's
        # runs) may still hold its weights and cache, kept alive by reference
        # cycles: free them before taking most of the card again.
        gc.collect()
        torch.cuda.empty_cache()
    if weights is not None:
        model, dtype = weights, next(weights.parameters()).dtype
    else:
        model = build_model(cfg, folder, dtype, device, seed=args.seed)
    spec = ModelSpec.from_hf_config(cfg.raw, name=name)
    dtype_name = str(dtype).removeprefix("torch.")
    if args.num_kv_blocks:
        blocks = args.num_kv_blocks
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        blocks = num_kv_blocks(
            spec,
            dtype_name,
            args.block_size,
            total,
            args.gpu_memory_utilization,
            2e9,
            args.kv_cache_bytes,
        )
    else:
        blocks = num_kv_blocks(
            spec, dtype_name, args.block_size, 0, 0, 0, args.kv_cache_bytes or CPU_KV_CACHE_BYTES
        )
    max_len = args.max_model_len or cfg.max_model_len
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    kv = KVCacheManager(blocks, args.block_size, args.enable_prefix_caching)
    scheduler = Scheduler(sched_cfg, kv, make_policy(args.policy))
    executor = ModelExecutor(
        model,
        blocks,
        args.block_size,
        select_backend(args.attention_backend, device),
        device,
        args.seed,
    )
    if device.type == "cuda":
        executor.warm_up()  # no kernel compiles inside a run's first steps
    engine = EngineCore(scheduler, executor, clock or WallClock(), token_validator(cfg.vocab_size))
    return engine, executor, cfg


def pin_cpus(cpus: Sequence[int]) -> None:
    """Pin this process (the engine's loop and torch's threads) to ``cpus``, so
    that other work on the machine runs on the other cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("hardware.cpus: pinning to cores needs Linux (os.sched_setaffinity)")
    wanted = set(cpus) if isinstance(cpus, Sequence) else set()
    if not wanted or not all(isinstance(c, int) and not isinstance(c, bool) for c in wanted):
        raise ValueError(f"hardware.cpus must be a non-empty list of core numbers, got {cpus!r}")
    usable = set(range(os.cpu_count() or 1))
    if not wanted <= usable:
        raise ValueError(
            f"hardware.cpus: cores {sorted(wanted - usable)} do not exist on this machine "
            f"(cores 0-{max(usable)})"
        )
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as e:  # cores this process may not use (a container's cpuset)
        raise ValueError(f"hardware.cpus: cannot pin to cores {sorted(wanted)}: {e}") from e


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
        self.engine, self.executor, self.config = build_engine(self.args)
        self.tokenizer = _load_tokenizer(model)
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

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.args.model!r} has no tokenizer: give token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(
            r.request_id,
            list(r.prompt_token_ids or []),
            list(r.output_token_ids),
            r.finish_reason or r.reject_reason,
            text,
        )


def _load_tokenizer(model: str):
    """The folder's tokenizer (local files only), or None."""
    path = Path(model)
    if not (path.is_dir() and (path / "tokenizer.json").exists()):
        return None
    from tokenizers import Tokenizer

    return _Tokenizer(Tokenizer.from_file(str(path / "tokenizer.json")))


class _Tokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
