"""A Llama-family decoder in plain torch, reading and writing a paged KV cache.

Module and parameter names follow transformers' (``model.layers.0.self_attn.q_proj``
and so on) so that HF checkpoints load as they are. The forward pass takes one
flattened batch of tokens from any number of requests (prefill chunks and
decodes mixed); attention goes through ``testbed.kernels`` (Triton on CUDA, the torch
reference elsewhere) with the batch's block tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from testbed.engine.model_config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context + new tokens
    max_query_len: int
    max_seq_len: int  # on the host: sizes the decode kernel's split without a sync


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    # float32 throughout, as transformers computes it (for bit-close parity).
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: long wavelengths are scaled down, short ones kept, a smooth blend between.
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding. Every layer of a forward pass rotates by the same
    positions, so the cos/sin of the last ``positions`` tensor are kept and reused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.ops = None  # fused CPU ops (testbed/engine/cpu_layer_ops.py); None: torch's

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cached
        if cached is not None and cached[0] is positions:
            return cached[1], cached[2]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        self._cached = (positions, cos, sin)  # holds positions: its id is not reused
        return cos, sin

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        if self.ops is not None:
            fused = [torch.empty(x.shape, dtype=x.dtype) for x in xs]
            for o, x in zip(fused, xs, strict=True):
                self.ops.rotary(o, x, cos, sin)
            return fused
        out = []
        for x in xs:  # [tokens, heads, head_dim], the "rotate half" convention of HF
            x1, x2 = x.float().chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
            out.append((x.float() * cos + rotated * sin).to(x.dtype))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = None  # fused CPU ops (testbed/engine/cpu_layer_ops.py); None: torch's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(x.shape, dtype=x.dtype)
            self.ops.rms_norm(out, x, self.weight, self.eps)
            return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5
        self.sizes = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        # {"qkv": ..., "o": ...}: packed CPU products (testbed/engine/cpu_linear.py)
        self.packed: dict | None = None

    def forward(self, x, positions, rope, meta: AttentionMetadata, kv_cache, backend):
        t = x.shape[0]
        if self.packed is not None:
            q, k, v = self.packed["qkv"](x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        key_cache, value_cache = kv_cache
        backend.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            out = backend.paged_attention_decode(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                max_context_len=meta.max_seq_len,
            )
        else:
            out = backend.paged_attention_prefill(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
            )
        out = out.reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out) if self.packed is None else self.packed["o"](out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        # {"gate_up": ..., "down": ...}: packed CPU products (testbed/engine/cpu_linear.py)
        self.packed: dict | None = None
        self.ops = None  # fused CPU ops (testbed/engine/cpu_layer_ops.py); None: torch's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.packed["gate_up"](x)
        if self.ops is not None:
            act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            self.ops.silu_and_mul(act, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = nn.functional.silu(gate) * up
        return self.packed["down"](act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, meta, kv_cache, backend):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, meta, kv_cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class CausalLM(nn.Module):
    """``forward`` returns hidden states of every token; ``logits`` projects the few
    that sample (computing the vocabulary projection for all would waste it)."""

    # On a CPU (float32), up to this many sampled rows compute the LM head as W·hᵀ
    # and copy it to [rows, vocab]; up to cpu_view_logits_rows return it as a
    # transposed view instead.
    cpu_wide_logits_rows = 11
    cpu_view_logits_rows = 64

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_head = None  # the LM head packed for a CPU (testbed/engine/cpu_linear.py)
        # A CPU's whole decoder layer in one C++ call (testbed/engine/cpu_layer_ops.py),
        # each layer's fixed arguments in its ``fused``; None: layer by layer.
        self.layer_op = None

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches, backend):
        m = self.model
        x = m.embed_tokens(input_ids)
        if m.norm.ops is not None and x.dim() == 2:
            return self._fused_forward(x, positions, meta, kv_caches, backend)
        for layer, kv_cache in zip(m.layers, kv_caches, strict=True):
            x = layer(x, positions, m.rotary_emb, meta, kv_cache, backend)
        return m.norm(x)

    def _fused_forward(self, residual, positions, meta, kv_caches, backend):
        """The same layers, each residual add fused with the norm that reads its sum
        (``add_rms_norm``, the CPU ops of testbed/engine/cpu_layer_ops.py): the
        residual stream is updated in place, one pass per add."""
        m = self.model
        ops = m.norm.ops

        def add_norm(h, norm):
            out = torch.empty_like(residual)
            ops.add_rms_norm(residual, h, norm.weight, out, norm.eps)
            return out

        h = None
        items = self._fused_layer_items(meta, residual.shape[0], kv_caches, backend)
        if items is not None:
            cos, sin = m.rotary_emb.cos_sin(positions)
            slots = meta.slot_mapping.long().contiguous()
            tables = meta.block_tables.int().contiguous()
            clock = getattr(backend, "clock", None)
            for layer, (key_cache, value_cache) in zip(m.layers, kv_caches, strict=True):
                attn = layer.self_attn
                h = self.layer_op(
                    residual, h, *layer.fused, cos, sin, key_cache, value_cache, slots,
                    tables, items, attn.scale, clock,
                )  # fmt: skip
            return add_norm(h, m.norm)
        for layer, kv_cache in zip(m.layers, kv_caches, strict=True):
            first = layer.input_layernorm
            x = first(residual) if h is None else add_norm(h, first)
            h = layer.self_attn(x, positions, m.rotary_emb, meta, kv_cache, backend)
            h = layer.mlp(add_norm(h, layer.post_attention_layernorm))
        return m.norm(residual) if h is None else add_norm(h, m.norm)

    def _fused_layer_items(self, meta, num_tokens: int, kv_caches, backend):
        """The attention kernel's items where the layers run as one C++ call each: the
        op is there, the backend is the CPU path (or a timer around it) and its kernel
        takes every query row of the step; else None."""
        native_items = getattr(getattr(backend, "backend", backend), "native_items", None)
        if self.layer_op is None or native_items is None or not kv_caches:
            return None
        return native_items(meta, num_tokens, self.config.num_heads, kv_caches[0][0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        rows, w = hidden.shape[0], self.lm_head.weight
        if (
            rows <= self.cpu_view_logits_rows
            and w.device.type == "cpu"
            and w.dtype == torch.float32
        ):
            # MKL's float32 GEMM is slow for a few rows times a wide matrix (2 or 3
            # rows of the 32000-word head cost more than 4) but fast as W·hᵀ with
            # at least two columns (benchmarks/lm_head.py): the same products,
            # 1.1–3x faster for 1 to 11 rows. From 12 rows on, copying the result
            # to [rows, vocab] costs more than it saves; as a transposed view, an
            # argmax over its rows costs less than the saving, up to 64 rows.
            if rows > self.cpu_wide_logits_rows:
                return (w @ hidden.T).T
            cols = hidden if rows > 1 else hidden.repeat(2, 1)
            return (w @ cols.T)[:, :rows].T.contiguous()
        return self.lm_head(hidden).float()
