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
a NaN or infinity in a masked slot cannot leak into a result.
"""

from __future__ import annotations


def visible(row, key, seq_q, seq_kv, window, causal: bool):
    """True where query ``row`` may attend to ``key`` (both indices inside one sequence)."""
    in_bounds = (row < seq_q) & (key < seq_kv)
    if not causal:
        return in_bounds
    pos = row + (seq_kv - seq_q)
    return in_bounds & (key <= pos) & (key > pos - window)
