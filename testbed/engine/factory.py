"""Build one real engine: model and weights, KV cache sized for the device,
scheduler with its policy, executor with its attention backend, on a clock."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from policies import make_policy
from testbed.core import EngineCore, KVCacheManager, Request, Scheduler, SchedulerConfig, WallClock
from testbed.core.kv_connector import PDConnector
from testbed.engine.args import CPU_KV_CACHE_BYTES, EngineArgs
from testbed.engine.device import pick_device, pick_dtype, pin_cpus
from testbed.engine.draft_model import DraftModelProposer, FirstLayers
from testbed.engine.executor import ModelExecutor
from testbed.engine.model import CausalLM
from testbed.engine.model_config import ModelConfig
from testbed.engine.ngram import NgramProposer
from testbed.engine.spec_config import SpeculativeConfig, resolve_draft
from testbed.engine.weights import build_model
from testbed.kernels import select_backend
from testbed.models import ModelSpec, ResolvedModel, num_kv_blocks, resolve_model, same_folder
from testbed.threads import governor


def engine_model(
    model: ResolvedModel | Mapping[str, Any] | str | Path, num_layers: int | None = None
) -> tuple[ModelConfig, Path | None, str]:
    """(config, weights folder or None for dummy weights, name) of a resolved model
    or of what :func:`~testbed.models.resolve_model` accepts: a model config group
    entry, a ``conf/model/`` name or an HF folder; with ``num_layers``, that model
    cut to its first layers (:meth:`~testbed.models.ResolvedModel.first_layers`)."""
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    resolved = resolved.first_layers(num_layers)
    return ModelConfig.of(resolved), resolved.folder, resolved.name


def make_proposer(
    speculative: SpeculativeConfig | None,
    target: CausalLM,
    target_model: tuple[ModelConfig, Path | None, str],
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    backend,
    device: torch.device,
    seed: int,
):
    """The drafts' proposer of ``speculative`` (None: no speculation). A draft model
    that is the target's own model shares its weights (its first layers)."""
    if speculative is None:
        return None
    k = speculative.num_speculative_tokens
    if speculative.method == "ngram":
        return NgramProposer(k, speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    target_cfg = target_model[0]
    cfg, folder, name = engine_model(resolve_draft(speculative, target_cfg, max_model_len))
    layers = speculative.draft_num_layers or cfg.num_layers
    same = cfg.raw == target_cfg.raw and (
        same_folder(folder, target_model[1]) or (folder, name) == target_model[1:]
    )
    dtype = next(target.parameters()).dtype
    base = target if same else build_model(cfg, folder, dtype, device, seed=seed)
    return DraftModelProposer(
        FirstLayers(base, layers), layers, k, num_blocks, block_size, backend, device, seed
    )


KV_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


def kv_connector(config: Mapping[str, Any] | None) -> PDConnector | None:
    """The scheduler's KV connector of a ``kv_transfer_config`` (None: none)."""
    if not config:
        return None
    role = config.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role: {role!r} is not one of {sorted(KV_ROLES)}")
    return PDConnector(KV_ROLES[role], int(config.get("kv_rank", 0)))


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
    cfg, folder, name = model or engine_model(args.model)
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
    speculative = SpeculativeConfig.of(args.speculative_config)
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        reserve_full_isl=args.reserve_full_isl,
        num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
        num_lookahead_tokens=speculative.num_lookahead_tokens if speculative else 0,
    )
    kv = KVCacheManager(blocks, args.block_size, args.enable_prefix_caching)
    scheduler = Scheduler(
        sched_cfg, kv, make_policy(args.policy), kv_connector(args.kv_transfer_config)
    )
    executor = ModelExecutor(
        model,
        blocks,
        args.block_size,
        select_backend(args.attention_backend, device),
        device,
        args.seed,
        proposer=make_proposer(
            speculative,
            model,
            (cfg, folder, name),
            max_len,
            blocks,
            args.block_size,
            select_backend(args.attention_backend, device),
            device,
            args.seed,
        ),
    )
    if device.type == "cpu" and args.threads is None:
        executor.threads = governor()  # one thread per core that others leave free
    executor.warm_up()  # no kernel compiles or loads inside a run's first steps
    engine = EngineCore(scheduler, executor, clock or WallClock(), token_validator(cfg.vocab_size))
    return engine, executor, cfg
