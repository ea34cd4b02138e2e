"""Indexing for the two memory layouts, so kernels read "bhsd" and "bshd" tensors in place.

``bhsd`` is ``[batch, heads, seq, dim]``; ``bshd`` is ``[batch, seq, heads, dim]``
(Hugging Face, FlashAttention). LSE and the row statistics are always ``[batch, heads, seq]``.
"""

import tilelang.language as T


def qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v):
    """Shapes of q, k, v and o for ``layout``."""
    if layout == "bhsd":
        return (
            [batch, heads, seq_q, dim],
            [batch, heads_kv, seq_kv, dim],
            [batch, heads_kv, seq_kv, dim_v],
            [batch, heads, seq_q, dim_v],
        )
    return (
        [batch, seq_q, heads, dim],
        [batch, seq_kv, heads_kv, dim],
        [batch, seq_kv, heads_kv, dim_v],
        [batch, seq_q, heads, dim_v],
    )


def tile(x, layout, b, h, s0, n):
    """The ``[n, dim]`` region of rows ``s0 .. s0+n`` of head ``h`` in batch ``b``."""
    if layout == "bhsd":
        return x[b, h, s0 : s0 + n, :]
    return x[b, s0 : s0 + n, h, :]




@T.macro
def store_rows(x, layout: str, b, h, s0, seq, src, rows: int, cols: int):
    """Write the ``[rows, cols]`` tile ``src`` to rows ``s0 ..`` of head ``h``, dropping the rows
    at or past ``seq`` (tiles that hang over the end of a sequence)."""
    for i, j in T.Parallel(rows, cols):
        if s0 + i < seq:
            if layout == "bhsd":
                x[b, h, s0 + i, j] = src[i, j]
            else:
                x[b, s0 + i, h, j] = src[i, j]
