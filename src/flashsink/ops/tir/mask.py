"""Which (query, key) pairs are visible, as TIR boolean expressions: ``flashsink.visibility``'s
convention (bottom-right alignment, window ``[i - W + 1, i]``, nothing past the end of a sequence),
built from its primitives. No window is ``W = NO_WINDOW``.

The kernels select with these (never multiply), so a NaN or infinity in a masked slot cannot leak
into a result.
"""

from __future__ import annotations

import tilelang.language as T

from ...visibility import last_key, position, window_edge
from .layout import tile_row


def visible(row, key, seq_q, seq_kv, window, causal: bool):
    """True where query ``row`` may attend to ``key`` (both indices inside one sequence)."""
    in_bounds = (row < seq_q) & (key < seq_kv)
    if not causal:
        return in_bounds
    pos = position(row, seq_q, seq_kv)
    return in_bounds & (key <= last_key(pos)) & (key > window_edge(pos, window))


@T.macro
def mask_logits(acc_s, row0, key0, sq, sk, window, scale_log2, fold_scale: bool, causal: bool,
                pack: int | None = None):
    """Masked slots of one tile of logits to -inf; visible ones scaled (unless ``fold_scale``).
    (``sq``, ``sk``: the sequence lengths, named as the caller's, which TileLang's script then keeps.)
    ``pack``: the tile holds a GQA group's heads, ``pack`` query positions each (``layout.tile_row``)."""
    for i, j in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
        acc_s[i, j] = T.if_then_else(
            visible(tile_row(row0, i, pack), key0 + j, sq, sk, window, causal),
            acc_s[i, j] if fold_scale else acc_s[i, j] * scale_log2,
            -T.infinity("float32"),
        )


@T.macro
def packed_logits(acc_s, rows, key0, seq_q, seq_kv, window, scale_log2, causal: bool, masked: bool):
    """The split-KV kernels' tile of logits, a GQA group's query rows packed (``rows``: ``layout.HeadMajor`` or
    ``QueryMajor``), scaled into base 2 and (``masked``: :func:`branch_tile`'s choice) -inf where a row does not
    see the key, and in the rows past the packed ones (their q is zero; never stored). ``seq_q``, ``seq_kv``:
    named as the callers' (a macro gives a variable it is passed its parameter's name)."""
    if masked:
        for i, j in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
            acc_s[i, j] = T.if_then_else(
                rows.inside(i) & visible(rows.query(i), key0 + j, seq_q, seq_kv, window, causal),
                acc_s[i, j] * scale_log2,
                -T.infinity("float32"),
            )
    else:
        scale_logits(acc_s, scale_log2, False)


def key_limits(row, key0, seq_q, seq_kv, window, causal: bool, select):
    """``(hi, lo)`` of query ``row`` relative to key ``key0``: key ``key0 + j`` is visible (:func:`visible`)
    exactly where ``lo < j <= hi``. ``select(cond, a, b)``: ``T.if_then_else`` in a kernel (Python's
    conditional in the tests)."""
    if causal:
        pos = position(row, seq_q, seq_kv)
        # a row inside its sequence has its last key inside it too (bottom-right alignment)
        return select(row < seq_q, last_key(pos) - key0, -1), window_edge(pos, window) - key0
    return select(row < seq_q, seq_kv - 1 - key0, -1), -1


@T.macro
def limit_logits(acc_s, limits, row0, key0, sq, sk, window, scale_log2, fold_scale: bool, causal: bool,
                 pack: int | None = None):
    """:func:`mask_logits` through each row's key limits: ``hi``, the last key the row sees, and ``lo``, the
    last one its window hides, both relative to the tile's first key ``key0`` and worked out once per row
    (``limits``: two int32 fragments of the tile's rows); each element then compares its column with the
    two (where :func:`visible` re-derives the row's position and tests both sequence ends per element:
    ~5 instructions per logit in the SASS, against 3 here). The same slots are masked: a row past the
    sequence sees nothing (``hi = -1``), a causal row's last key is inside its sequence."""
    key_hi, key_lo = limits
    # both sides less the thread's column offset in the wgmma accumulator (2 * (lane % 4)): the column
    # then folds to a constant per register and each test is one compare with an immediate (any other
    # offset would give the same answers)
    off = 2 * (T.get_thread_binding() % 4)
    for i in T.Parallel(acc_s.shape[0]):
        last, hidden = key_limits(tile_row(row0, i, pack), key0, sq, sk, window, causal, T.if_then_else)
        key_hi[i] = last - off
        key_lo[i] = hidden - off
    for i, j in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
        acc_s[i, j] = T.if_then_else(
            (j - off <= key_hi[i]) & (j - off > key_lo[i]),
            acc_s[i, j] if fold_scale else acc_s[i, j] * scale_log2,
            -T.infinity("float32"),
        )


@T.macro
def scale_logits(acc_s, scale_log2, fold_scale: bool):
    """A wholly visible tile: only the scale (nothing when it is folded into the exponent)."""
    if not fold_scale:
        for i, j in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
            acc_s[i, j] = acc_s[i, j] * scale_log2


@T.macro
def branch_logits(acc_s, row0, key0, sq, sk, window, scale_log2, fold_scale: bool, full, kb, causal: bool,
                  pack: int | None = None, limits=None):
    """:func:`mask_logits` where KV block ``kb`` is not wholly visible, else only the scale
    (:func:`scale_logits`): ``full`` (flo, fhi) is the tile's wholly visible blocks
    (``block_range.full_kv_blocks_for_rows``), bound once per tile; the branch is per tile. ``limits``
    (two int32 row fragments): the mask by :func:`limit_logits` instead."""
    if in_blocks(kb, full):
        scale_logits(acc_s, scale_log2, fold_scale)
    else:
        if limits is None:
            mask_logits(acc_s, row0, key0, sq, sk, window, scale_log2, fold_scale, causal, pack)
        else:
            limit_logits(acc_s, limits, row0, key0, sq, sk, window, scale_log2, fold_scale, causal, pack)


@T.macro
def branch_tile(tile_fn, full, *args):
    """The main backward's per-tile branch: ``tile_fn(*args, masked)`` without the per-element mask
    where the tile is wholly visible (``full``, a condition such as :func:`in_blocks`), with it
    elsewhere; ``full`` None (no branch): with the mask on every tile."""
    if full is None:
        tile_fn(*args, True)
    else:
        if full:
            tile_fn(*args, False)
        else:
            tile_fn(*args, True)


def in_blocks(i, blocks):
    """Block ``i`` lies in ``blocks`` = ``(lo, hi)`` (a tile's wholly visible blocks)."""
    return (i >= blocks[0]) & (i < blocks[1])


def select_visible(value, row, key, seq_q, seq_kv, window, causal: bool, masked: bool):
    """``value`` where ``(row, key)`` is visible, else an exact 0 (selected, not multiplied); with
    ``masked`` False (a wholly visible tile: the main backward's branch), ``value`` as it is."""
    if not masked:
        return value
    return T.if_then_else(visible(row, key, seq_q, seq_kv, window, causal), value, 0.0)
