"""Build one real engine: model and weights, KV cache sized for the device (the
simulator's formula, with the activation peak a warm-up pass measures on a GPU),
scheduler with its policy, executor with its attention backend, on a clock."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from policies import make_policy
from testbed.core import EngineCore, Request, SamplingParams, SchedulerConfig, WallClock
from testbed.core.kv_connector import PDConnector
from testbed.engine import cpu_layer_ops, cpu_linear, cpu_memory
from testbed.engine.args import CPU_KV_CACHE_BYTES, EngineArgs
from testbed.engine.batch import flatten
from testbed.engine.device import pick_device, pick_dtype, pin_cpus
from testbed.engine.draft_model import DraftModelProposer, FirstLayers
from testbed.engine.executor import ModelExecutor
from testbed.engine.model import CausalLM
from testbed.engine.model_config import ModelConfig
from testbed.engine.ngram import NgramProposer
from testbed.engine.sampler import Sampler
from testbed.engine.spec_config import SpeculativeConfig, resolve_draft
from testbed.engine.weights import build_model
from testbed.kernels import select_backend
from testbed.models import (
    GPUMemory,
    ModelSpec,
    ResolvedModel,
    num_kv_blocks,
    resolve_model,
    same_folder,
)
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
    if device.type == "cpu":
        cpu_linear.pack(base)
        cpu_layer_ops.enable(base)
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
    if device.type == "cpu":
        cpu_linear.pack(model)  # where it cannot, F.linear runs (cpu_linear.route says why)
        cpu_layer_ops.enable(model)  # where it cannot, the torch modules run
        cpu_memory.keep_freed_memory()  # where it cannot (not glibc), malloc's defaults
    spec = ModelSpec.from_hf_config(cfg.raw, name=name)
    dtype_name = str(dtype).removeprefix("torch.")
    max_len = args.max_model_len or cfg.max_model_len
    speculative = SpeculativeConfig.of(args.speculative_config)
    config = SchedulerConfig.of(args, max_len, speculative)
    policy = make_policy(args.policy)
    connector = kv_connector(args.kv_transfer_config)
    backend = select_backend(args.attention_backend, device)
    blocks = engine_kv_blocks(
        args,
        spec,
        dtype_name,
        device,
        lambda: measure_gpu_memory(
            model, backend, device, config, args.block_size, args.gpu_memory_utilization
        ),
    )
    executor = ModelExecutor(
        model,
        blocks,
        args.block_size,
        backend,
        device,
        args.seed,
        proposer=make_proposer(
            speculative,
            model,
            (cfg, folder, name),
            max_len,
            blocks,
            args.block_size,
            backend,
            device,
            args.seed,
        ),
    )
    if device.type == "cpu" and args.threads is None:
        executor.threads = governor()  # one thread per core that others leave free
    executor.warm_up()  # no kernel compiles or loads inside a run's first steps
    engine = EngineCore.build(
        executor,
        policy,
        blocks,
        args.block_size,
        args.enable_prefix_caching,
        clock or WallClock(),
        config=config,
        connector=connector,
        validate=token_validator(cfg.vocab_size),
    )
    return engine, executor, cfg


def engine_kv_blocks(
    args: EngineArgs,
    spec: ModelSpec,
    dtype: str,
    device: torch.device,
    measure: Callable[[], GPUMemory],
) -> int:
    """The engine's KV blocks (:func:`~testbed.models.num_kv_blocks`, the simulator's
    formula): ``args.num_kv_blocks``, else a fixed ``kv_cache_bytes`` budget (on a CPU
    512 MiB by default), else on a GPU what ``measure()`` leaves of its memory."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    if device.type != "cuda":
        return num_kv_blocks(
            spec, dtype, args.block_size, args.kv_cache_bytes or CPU_KV_CACHE_BYTES
        )
    if args.kv_cache_bytes is not None:
        return num_kv_blocks(spec, dtype, args.block_size, args.kv_cache_bytes)
    return num_kv_blocks(spec, dtype, args.block_size, memory=measure())


def largest_step(config: SchedulerConfig) -> list[int]:
    """The query lengths of the step whose activations take the most memory: the
    whole token budget over as many requests as may run (each a decode of one
    token, or a verification of every draft), one prompt taking what they leave
    (the longest query), none past ``max_model_len``."""
    per_request = 1 + config.num_speculative_tokens
    budget = config.max_num_batched_tokens
    lens = [per_request] * max(1, min(config.max_num_seqs, budget // per_request))
    left = budget - sum(lens)
    for i, n in enumerate(lens):
        more = max(0, min(left, config.max_model_len - n))
        lens[i], left = n + more, left - more
    return lens


@torch.inference_mode()
def run_largest_step(
    model: CausalLM, backend, device: torch.device, config: SchedulerConfig, block_size: int
) -> int:
    """One forward pass and sampling at :func:`largest_step`, every request from
    its first token, each sampling at its last ``1 + num_speculative_tokens``
    tokens (top-p: the sampler's largest temporaries) into a KV cache of just the
    blocks it needs; the bytes of that cache."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    rows, sample_idx, first_block, start = [], [], 0, 0
    for n in largest_step(config):
        num_blocks = -(-n // block_size)
        tokens = [(start + j) % cfg.vocab_size for j in range(n)]
        rows.append((list(range(first_block, first_block + num_blocks)), tokens, 0))
        start, first_block = start + n, first_block + num_blocks
        sample_idx.extend(range(start - min(n, 1 + config.num_speculative_tokens), start))
    shape = (first_block, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    ids, positions, meta, _ = flatten(rows, block_size, device)
    hidden = model(ids, positions, meta, caches, backend)
    logits = model.logits(hidden[sample_idx])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    Sampler(device).sample(
        logits, [str(i) for i in range(len(sample_idx))], [params] * len(sample_idx)
    )
    return 2 * len(caches) * caches[0][0].numel() * caches[0][0].element_size()


def measure_gpu_memory(
    model: CausalLM,
    backend,
    device: torch.device,
    config: SchedulerConfig,
    block_size: int,
    memory_utilization: float,
) -> GPUMemory:
    """The real engine's inputs to the KV-cache formula on a GPU, measured as
    nano-vllm measures them: the device's memory, what the process holds once the
    weights are loaded, and the most that a warm-up pass at the largest step
    (:func:`run_largest_step`) allocates above that, its own small KV cache aside."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    cache = run_largest_step(model, backend, device, config, block_size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - cache
    torch.cuda.empty_cache()  # the pass's cache and activations, back to the device
    total = torch.cuda.get_device_properties(device).total_memory
    return GPUMemory(total, memory_utilization, weights, peak)
