"""Which (query, key) pairs are visible.

Conventions (README, "Conventions"):

- query row ``r`` of ``seq_q`` rows sits at absolute position ``r + (seq_kv - seq_q)``:
  with fewer queries than keys the causal mask aligns bottom-right (KV cache, chunked
  prefill);
- with a window ``W`` a query at position ``i`` sees keys ``[i - W + 1, i]``
  (FlashAttention's ``window_size=(W - 1, 0)``); no window is ``W = NO_WINDOW``;
- rows and keys past the end of the sequence are never visible, so tiles that hang over
  the end of a sequence contribute nothing.

These return TIR boolean expressions; the kernels select with them (never multiply), so
a NaN or infinity in a masked slot cannot leak into a result. ``tile_visible`` says a whole
tile is visible: the kernels branch on it once per tile and skip the per-element mask.
"""

from __future__ import annotations


def visible(row, key, seq_q, seq_kv, window, causal: bool):
    """True where query ``row`` may attend to ``key`` (both indices inside one sequence)."""
    in_bounds = (row < seq_q) & (key < seq_kv)
    if not causal:
        return in_bounds
    pos = row + (seq_kv - seq_q)
    return in_bounds & (key <= pos) & (key > pos - window)


def tile_visible(row0, block_m, key0, block_n, seq_q, seq_kv, window, causal: bool):
    """True where every pair of the tile (rows ``[row0, row0 + block_m)`` x keys
    ``[key0, key0 + block_n)``) is visible: the kernels skip the per-element mask there
    (most tiles of a long causal problem), and evaluate ``visible`` on the edge tiles."""
    inside = (row0 + block_m <= seq_q) & (key0 + block_n <= seq_kv)
    if not causal:
        return inside
    shift = seq_kv - seq_q
    # the last key is no later than the first row's position, and the first key is inside
    # the last row's window
    return inside & (key0 + block_n - 1 <= row0 + shift) & (key0 > row0 + block_m - 1 + shift - window)
