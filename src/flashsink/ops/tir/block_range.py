"""Which blocks a tile must visit: the mask of ``mask.py`` at block granularity, built from the
primitives of ``flashsink.visibility``.

Both functions return ``(lo, hi)`` with ``lo <= hi``; blocks outside are wholly masked,
and a tile that starts past the end of its sequence gets an empty range (the idle programs of
the packed schedule, ``schedule.py``, have such tiles),
so the cost of a windowed layer grows with ``N * W``, not ``N**2``. Any window size
works: the range is rounded outwards to whole blocks and ``mask.visible`` trims the
edges.
"""

from __future__ import annotations

import tilelang.language as T

from ...visibility import first_key, first_query, last_key, position, query_end, row_at


def kv_blocks_for_rows(row0, block_m, block_n, seq_q, seq_kv, window, causal: bool):
    """KV blocks ``[lo, hi)`` that query rows ``[row0, row0 + block_m)`` can see."""
    n_blocks = T.ceildiv(seq_kv, block_n)
    has_rows = _positive(seq_q - row0)
    if not causal:
        return 0, n_blocks * has_rows
    first_pos = position(row0, seq_q, seq_kv)
    last_pos = position(T.min(row0 + block_m, seq_q) - 1, seq_q, seq_kv)
    lo = T.max(first_key(first_pos, window), 0) // block_n
    hi = T.min(n_blocks, T.ceildiv(T.max(last_key(last_pos) + 1, 0), block_n))
    return lo, lo + T.max(hi - lo, 0) * has_rows


def full_kv_blocks_for_rows(lo, hi, row0, block_m, block_n, seq_q, seq_kv, window, causal: bool):
    """The wholly visible KV blocks ``[flo, fhi)`` of rows ``[row0, row0 + block_m)``, inside the
    tile's range ``[lo, hi)`` (:func:`kv_blocks_for_rows`): every (row, key) of such a block is
    visible, so a kernel may skip the per-element mask there. ``lo <= flo <= fhi <= hi``; the
    blocks ``[lo, flo)`` (a window's leading edge) and ``[fhi, hi)`` (the diagonal, a partial
    last block) need the mask. A tile hanging over the end of its sequence has none."""
    rows_in = _positive(seq_q - (row0 + block_m) + 1)  # every row of the tile is inside
    if not causal:
        flo, fhi_raw = lo, seq_kv // block_n
    else:
        shift = seq_kv - seq_q
        first_pos = row0 + shift
        last_pos = row0 + block_m - 1 + shift
        # block j is full iff j*bn >= last_pos - window + 1, (j+1)*bn - 1 <= first_pos, (j+1)*bn <= seq_kv
        flo = T.min(T.max(T.ceildiv(T.max(last_pos - window + 1, 0), block_n), lo), hi)
        fhi_raw = T.min(T.max(first_pos + 1, 0) // block_n, seq_kv // block_n)
    return flo, flo + T.max(T.min(fhi_raw, hi) - flo, 0) * rows_in


@T.macro
def split_blocks(lo, hi, of):
    """The share ``[my_lo, my_hi)`` of the KV blocks ``[lo, hi)`` that split ``s`` of ``n`` (``of = (s, n)``)
    visits in the split-KV kernels: ``ceil((hi - lo) / n)`` consecutive blocks a split, the last splits' fewer
    or none. A macro, so that the share per split is bound once; ``of`` a pair, so that the macro does not
    give the caller's split (fwd_split's grid index) a name of its own (nor unpacks it)."""
    per = T.ceildiv(hi - lo, of[1])
    my_lo = T.min(hi, lo + of[0] * per)
    my_hi = T.min(hi, my_lo + per)
    return my_lo, my_hi


def row_blocks_for_keys(key0, block_n, block_m, seq_q, seq_kv, window, causal: bool):
    """Query-row blocks ``[lo, hi)`` that can see keys ``[key0, key0 + block_n)``."""
    m_blocks = T.ceildiv(seq_q, block_m)
    has_keys = _positive(seq_kv - key0)
    if not causal:
        return 0, m_blocks * has_keys
    # the first row that sees the first key, one past the last row that sees the last key
    first_row = T.max(row_at(first_query(key0), seq_q, seq_kv), 0)
    last_row_plus1 = T.max(row_at(query_end(key0 + block_n - 1, window), seq_q, seq_kv), 0)
    lo = first_row // block_m
    hi = T.min(m_blocks, T.ceildiv(last_row_plus1, block_m))
    return lo, lo + T.max(hi - lo, 0) * has_keys


def full_row_blocks_for_keys(lo, hi, key0, block_n, block_m, seq_q, seq_kv, window, causal: bool):
    """The wholly visible query-row blocks ``[flo, fhi)`` of keys ``[key0, key0 + block_n)``, inside
    the tile's range ``[lo, hi)`` (:func:`row_blocks_for_keys`): the main backward's mirror of
    :func:`full_kv_blocks_for_rows`. The blocks ``[lo, flo)`` (the diagonal) and ``[fhi, hi)`` (a
    window's trailing edge, a partial last row block) need the mask. A KV tile hanging over the end
    of its sequence has none."""
    keys_in = _positive(seq_kv - (key0 + block_n) + 1)  # every key of the tile is inside
    if not causal:
        flo, fhi_raw = lo, seq_q // block_m
    else:
        # row block i is full iff its first row sees the tile's last key (causal), the row one past
        # its last still sees the tile's first key (window), and it ends inside the sequence; the
        # window is capped so that key0 + window cannot overflow int32 (a cap past every row)
        first_row = T.max(row_at(first_query(key0 + block_n - 1), seq_q, seq_kv), 0)
        end_row = T.max(row_at(query_end(key0, T.min(window, seq_q + seq_kv + block_m)), seq_q, seq_kv), 0)
        flo = T.min(T.max(T.ceildiv(first_row, block_m), lo), hi)
        fhi_raw = T.min(end_row // block_m, seq_q // block_m)
    return flo, flo + T.max(T.min(fhi_raw, hi) - flo, 0) * keys_in


def _positive(x):
    """1 where ``x > 0`` else 0, as integer arithmetic (folds to an int for int inputs)."""
    return T.min(T.max(x, 0), 1)
