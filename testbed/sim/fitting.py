"""The profile model's terms and its non-negative least-squares fit."""

from __future__ import annotations

import numpy as np

KNOTS = (2, 8, 32)  # batch sizes where a CPU or GPU GEMM changes regime
# Tokens computed past which a GPU's linear layers turn from reading their weights
# (the same time for 1 token as for 100) to compute-bound (a time per token): the
# roofline's knee, at about 150-300 tokens for 16-bit weights on an A100-H200. A
# CPU's GEMMs are compute-bound from the first token, and its fit leaves these at 0.
TOKEN_KNOTS = (128, 512)
KV_KNOTS = (8192, 32768)  # KV tokens read past which attention outgrows the caches
PAIR_KNOTS = (2**17, 2**19)  # attention pairs (a 512- and a 1,024-token prefill) likewise
# Decode-only batches of up to this many requests each get their own term (where
# the profile has at least DECODE_SIZE_ROWS of them): a CPU GEMM's cost is not
# smooth in its rows at small sizes (with one thread, the LM head of 2 or 3 rows
# reads its weights once per row, of 4 or more once in all, so 3 decodes cost
# more than 4).
DECODE_SIZES = 16
DECODE_SIZE_ROWS = 3


def decode_size(num_reqs: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """The size of each decode-only batch (each request computing one token) of
    at most :data:`DECODE_SIZES` requests; 0 for any other step."""
    reqs = np.asarray(num_reqs)
    plain = (np.asarray(num_tokens) == reqs) & (reqs <= DECODE_SIZES)
    return np.where(plain, reqs, 0).astype(np.int64)


def profile_basis(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv) -> list:
    """The fitted model's terms: a constant; the batch size, also through concave
    ramps ``min(num_reqs, k)`` (a matrix product costs nearly the same for 1 and
    2 rows, then grows with rows); tokens, also through convex hinges (a GPU's
    weight-bound steps turning compute-bound, :data:`TOKEN_KNOTS`); attention
    pairs and KV tokens read, both also through convex hinges ``max(x - k, 0)``
    (work that outgrows the caches costs more per unit); and the longest context
    (kernels that loop over its chunks or pad to it). Small decode-only batches
    also get a term per size (:func:`decode_size`), which :class:`ProfileModel`
    fits with these and adds by lookup."""
    return [
        1.0,
        num_reqs,
        *ramps(num_reqs, KNOTS),
        num_tokens,
        *hinges(num_tokens, TOKEN_KNOTS),
        attn_pairs,
        *hinges(attn_pairs, PAIR_KNOTS),
        kv_tokens,
        *hinges(kv_tokens, KV_KNOTS),
        max_kv,
    ]


def ramps(x, knots: tuple) -> list:
    """Concave ramps ``min(x, k)`` of a number or an array."""
    if isinstance(x, np.ndarray):
        return [np.minimum(x, k) for k in knots]
    return [min(x, k) for k in knots]


def hinges(x, knots: tuple) -> list:
    """Convex hinges ``max(x - k, 0)`` of a number or an array."""
    if isinstance(x, np.ndarray):
        return [np.maximum(x - k, 0) for k in knots]
    return [max(x - k, 0) for k in knots]


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set), small problems only."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=0) <= 1e-12 * max(1.0, abs(grad).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x
