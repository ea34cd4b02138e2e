"""Indexing for the three memory layouts, so kernels read and write tensors in place.

- ``bhsd``: ``[batch, heads, seq, dim]``;
- ``bshd``: ``[batch, seq, heads, dim]`` (Hugging Face, FlashAttention);
- ``thd``: packed variable-length batches, ``[total_tokens, heads, dim]``; sequence ``b`` is
  rows ``cu_seqlens[b] : cu_seqlens[b + 1]``.

Kernels address a sequence by ``(base, length)`` (:func:`sequence`): the row where it starts in
the tensor (0 for the padded layouts, where ``b`` selects it) and its length. Masks and block
ranges work in sequence-local rows; only addresses add ``base``.

Row statistics (LSE, Delta) and the fp32 dQ accumulator are ``[batch, heads, rows_pad]``
(padded layouts) or ``[heads, rows_pad]`` (``thd``, rows are packed tokens), with ``rows_pad``
at least one row tile past the last row, so whole-tile reads stay in bounds.
"""

import tilelang.language as T


def prologue_load(cfg):
    """How a tile loaded once before a program's loop, under a condition (only when the loop
    has work), is lowered: one bulk copy waited on at once on Hopper; the default (synchronous)
    copy elsewhere (asking sm_80 for "tma" is a compile error)."""
    return "tma" if cfg.hopper else None


def qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v):
    """Shapes of q, k, v and o for ``layout`` (for ``thd``, ``seq_*`` are the total token counts)."""
    if layout == "bhsd":
        return (
            [batch, heads, seq_q, dim],
            [batch, heads_kv, seq_kv, dim],
            [batch, heads_kv, seq_kv, dim_v],
            [batch, heads, seq_q, dim_v],
        )
    if layout == "thd":
        return ([seq_q, heads, dim], [seq_kv, heads_kv, dim], [seq_kv, heads_kv, dim_v], [seq_q, heads, dim_v])
    return (
        [batch, seq_q, heads, dim],
        [batch, seq_kv, heads_kv, dim],
        [batch, seq_kv, heads_kv, dim_v],
        [batch, seq_q, heads, dim_v],
    )


def stat_shape(layout, batch, heads, rows_pad):
    """Shape of a per-row fp32 statistic (LSE, Delta)."""
    return [heads, rows_pad] if layout == "thd" else [batch, heads, rows_pad]


def sequence(layout, cu_seqlens, b, seq):
    """``(base, length)`` of sequence ``b``: ``seq`` rows from row 0 of batch ``b``, or the
    ``cu_seqlens`` slice of the packed tensor."""
    if layout == "thd":
        return cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
    return 0, seq


def tile(x, layout, b, h, s0, n):
    """The ``[n, dim]`` region of rows ``s0 .. s0+n`` of head ``h`` (``s0`` includes the base)."""
    if layout == "bhsd":
        return x[b, h, s0 : s0 + n, :]
    if layout == "thd":
        return x[s0 : s0 + n, h, :]
    return x[b, s0 : s0 + n, h, :]


def stat_tile(x, layout, b, h, r0, n):
    """Rows ``r0 .. r0+n`` of a statistic or of the dQ accumulator, for head ``h``."""
    if layout == "thd":
        return x[h, r0 : r0 + n]
    return x[b, h, r0 : r0 + n]


def acc_tile(x, layout, b, h, r0, n):
    """Rows ``r0 .. r0+n`` of an fp32 ``[.., rows_pad, D]`` accumulator (dQ; dK/dV when the main
    backward splits a GQA group), for head ``h``."""
    if layout == "thd":
        return x[h, r0 : r0 + n, :]
    return x[b, h, r0 : r0 + n, :]


def stat_at(x, layout, b, h, r):
    """Row ``r`` of a statistic, for head ``h``."""
    return x[h, r] if layout == "thd" else x[b, h, r]


@T.macro
def store_rows(x, layout: str, b, h, base, s0, seq, src, rows: int, cols: int):
    """Write the ``[rows, cols]`` tile ``src`` to rows ``base + s0 ..`` of head ``h``, dropping
    the rows at or past ``seq`` (tiles that hang over the end of a sequence)."""
    for i, j in T.Parallel(rows, cols):
        if s0 + i < seq:
            if layout == "bhsd":
                x[b, h, base + s0 + i, j] = src[i, j]
            elif layout == "thd":
                x[base + s0 + i, h, j] = src[i, j]
            else:
                x[b, base + s0 + i, h, j] = src[i, j]


@T.macro
def store_stat(x, layout: str, b, h, base, s0, seq, src, rows: int):
    """Write the per-row statistic ``src`` of rows ``s0 .. s0+rows``. Padded layouts own their
    padding rows, so the whole tile is copied; packed rows past ``seq`` belong to the next
    sequence and are dropped."""
    if layout == "thd":
        for i in T.Parallel(rows):
            if s0 + i < seq:
                x[h, base + s0 + i] = src[i]
    else:
        T.copy(src, x[b, h, s0 : s0 + rows])
