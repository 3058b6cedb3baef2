"""Tiny models for engine tests: HF checkpoints written to a temporary folder."""

from __future__ import annotations

from pathlib import Path

import torch

from testbed.engine.model import AttentionMetadata, CausalLM
from testbed.kernels import torch_attention as torch_reference

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def write_hf_model(kind: str, folder: Path, seed: int = 0):
    """A randomly initialised transformers model of ``kind``, saved as safetensors."""
    import transformers

    cfg_name, model_name, extra = ARCHS[kind]
    config = getattr(transformers, cfg_name)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random norms and biases too, so that a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def run_prefill(
    model: CausalLM,
    token_ids: list[int],
    chunk: int | None = None,
    block_size: int = 4,
    backend=torch_reference,
) -> torch.Tensor:
    """Logits of every position, computed through the paged cache in chunks."""
    cfg = model.config
    n = len(token_ids)
    blocks = -(-n // block_size)
    shape = (blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = next(model.parameters()).dtype
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_layers)
    ]
    table = list(range(blocks, 0, -1))  # a non-contiguous table
    out = []
    chunk = chunk or n
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pos = torch.arange(start, end)
        t = torch.tensor(table, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=t[pos // block_size] * block_size + pos % block_size,
            block_tables=torch.tensor([table], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
        )
        with torch.inference_mode():
            h = model(torch.tensor(token_ids[start:end]), pos, meta, caches, backend)
            out.append(model.logits(h))
    return torch.cat(out)
