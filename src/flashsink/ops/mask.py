"""Which (query, key) pairs are visible, as TIR boolean expressions: ``flashsink.visibility``'s
convention (bottom-right alignment, window ``[i - W + 1, i]``, nothing past the end of a sequence),
built from its primitives. No window is ``W = NO_WINDOW``.

The kernels select with these (never multiply), so a NaN or infinity in a masked slot cannot leak
into a result.
"""

from __future__ import annotations

from ..visibility import last_key, position, window_edge


def visible(row, key, seq_q, seq_kv, window, causal: bool):
    """True where query ``row`` may attend to ``key`` (both indices inside one sequence)."""
    in_bounds = (row < seq_q) & (key < seq_kv)
    if not causal:
        return in_bounds
    pos = position(row, seq_q, seq_kv)
    return in_bounds & (key <= last_key(pos)) & (key > window_edge(pos, window))
