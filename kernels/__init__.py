"""Triton kernels for paged attention, each beside a torch reference with the same
signature (the real engine's hot path on CUDA; the references run on CPU).

Not written yet: see the kernels issue. The cache layout they will share is
``[num_blocks, block_size, num_kv_heads, head_dim]`` with ``int32`` block tables.
"""
