"""Weights: HF safetensors checkpoints (single or sharded), or seeded dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from testbed.engine.model import CausalLM
from testbed.models import read_hf_config


def init_dummy(model: CausalLM, seed: int = 0) -> None:
    """Seeded weights of the right shapes: any architecture runs with no download.

    Linear layers get unit gain (std 1/sqrt(fan_in)) and embeddings a small
    scale, so that the layers, not the input embedding, dominate the residual
    stream: greedy outputs then vary from token to token (a dummy model that
    repeats its input token would make batch-invariance tests trivially true)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen, device=device)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(randn(p) * 0.02)
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(randn(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(randn(p) * 0.02)  # embeddings


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed shard index ({e})") from e
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = [folder / "model.safetensors"]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint file(s) missing in {folder}: {', '.join(f.name for f in missing)}"
        )
    return files


def load_checkpoint(model: CausalLM, folder: str | Path) -> None:
    """Load every parameter from the folder's safetensors; names must match exactly,
    except that a model built with fewer decoder layers than the folder's config
    says (:meth:`~testbed.models.ResolvedModel.first_layers`) skips the rest."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    expected = dict(model.named_parameters())
    kept = model.config.num_layers
    cut = int(read_hf_config(folder).get("num_hidden_layers", kept)) > kept
    loaded: set[str] = set()
    for file in checkpoint_files(folder):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        for name, tensor in tensors.items():
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # some exports keep this buffer; we compute it
                if cut and _layer_index(name, -1) >= kept:
                    continue  # a layer the cut model leaves out
                raise ValueError(f"{file}: unexpected tensor {name!r} for this architecture")
            param = expected[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{file}: {name} has shape {tuple(tensor.shape)}, the config "
                    f"says {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
    missing = set(expected) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")  # shared with the embedding
    if missing:
        raise ValueError(
            f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
        )


def _layer_index(name: str, default: int) -> int:
    """The decoder layer a parameter name belongs to (``model.layers.<i>.``)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return default


def build_model(
    cfg, folder: str | Path | None, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> CausalLM:
    """The model with real weights from ``folder``, or dummy weights when it is None."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    if folder is None and device.type != "cpu":
        # Dummy weights on an accelerator are made there, in the run's dtype: an 8B
        # model's float32 copy on the host would take 32 GB and a minute or more of
        # host random numbers, in every process that builds it (other values than
        # the CPU's for the same seed; a seed reproduces them on the same device).
        model = model.to(dtype).to_empty(device=device)
        init_dummy(model, seed)
    else:
        model = model.to_empty(device="cpu")
        if folder is None:
            init_dummy(model, seed)
        else:
            load_checkpoint(model, folder)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype)
    model.model.rotary_emb.inv_freq = _inv_freq(cfg).to(device)  # stays float32
    return model.eval()


def _inv_freq(cfg) -> torch.Tensor:
    from testbed.engine.model import rope_inv_freq

    return rope_inv_freq(cfg)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
