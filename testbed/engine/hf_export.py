"""A model's seeded dummy weights written as an HF folder, for engines that load
only checkpoints (vLLM): ``config.json`` and ``model.safetensors``.

The weights are :func:`~testbed.engine.weights.init_dummy`'s for the same seed,
under HF's parameter names (the project's model already uses them), so this
project's engine and another one run the same model. Folders are cached by the
config's content and the seed, and written atomically (a folder that exists is
complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from testbed.engine.factory import engine_model
from testbed.engine.weights import build_model
from testbed.models import ResolvedModel

DEFAULT_CACHE = Path(os.environ.get("TESTBED_HF_CACHE", Path.home() / ".cache/testbed/hf-dummy"))


def hf_folder(model: ResolvedModel, seed: int, cache: Path = DEFAULT_CACHE) -> Path:
    """The model's weights folder: its own where it has one, else its dummy weights
    for ``seed`` written under ``cache`` (once)."""
    if model.folder is not None:
        return model.folder
    key = hashlib.sha256(json.dumps(model.hf_config, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache / f"{model.name}-{key}-seed{seed}"
    if not (folder / "config.json").exists():
        save_dummy(model, seed, folder)
    return folder


def save_dummy(model: ResolvedModel, seed: int, folder: Path) -> None:
    """Write ``model``'s dummy weights (float32) and HF config into ``folder``."""
    cfg, _, _ = engine_model(model)
    module = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=seed)
    params = {name: p.detach().contiguous() for name, p in module.named_parameters()}
    if model.hf_config.get("tie_word_embeddings"):
        params.pop("lm_head.weight", None)  # the checkpoint holds the embedding once
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(params, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {**model.hf_config, "torch_dtype": "float32"}
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another process wrote it first: theirs is the same
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
