"""Which (query, key) pairs are visible: the one home of the mask convention (README, "Conventions").

- Query row ``r`` of ``seq_q`` rows sits at absolute position ``r + (seq_kv - seq_q)``: with fewer
  queries than keys the causal mask aligns bottom-right (KV cache, chunked prefill).
- Causal: a query at position ``i`` sees keys up to ``i``. A window ``W`` also hides keys up to
  ``i - W``, so the query sees ``[i - W + 1, i]`` (FlashAttention's ``window_size=(W - 1, 0)``). The
  public functions take a window only with ``causal=True``; the host functions here apply each bound
  on its own (a window without ``causal`` bounds the keys from below only). "No window" is ``None``
  here, ``W = NO_WINDOW`` (wider than any sequence) in the kernels.
- Rows and keys past the end of the sequence are never visible.

The primitives (``position`` ... ``query_end``) are plain arithmetic, so one definition serves Python
ints, torch tensors (``reference.visible_mask``) and TileLang expressions (``ops/tir/mask.py``,
``ops/tir/block_range.py``, which build the kernels' masks and block ranges from them). Keep them the
exact expressions the kernels were written with: a kernel's TIR is built from them, term by term
(``tools/tir_hashes.py`` checks that a refactor leaves it unchanged). The rest (key ranges, pair
counts, used by the split-KV decode, the benchmark's FLOP counts) is host-side Python over those
primitives. No tilelang or torch import: the reference and the benchmark use this without them.
"""

from __future__ import annotations


def position(row, seq_q, seq_kv):
    """Absolute position of query row ``row`` (bottom-right alignment)."""
    return row + (seq_kv - seq_q)


def row_at(pos, seq_q, seq_kv):
    """The query row at absolute position ``pos`` (inverse of :func:`position`)."""
    return pos - (seq_kv - seq_q)


def last_key(pos):
    """The last key a causal query at ``pos`` sees."""
    return pos


def window_edge(pos, window):
    """The last key a query at ``pos`` does not see for its window (keys up to here are hidden)."""
    return pos - window


def first_key(pos, window):
    """The first key a query at ``pos`` sees with ``window``."""
    return window_edge(pos, window) + 1


def first_query(key):
    """The first position whose causal mask shows ``key``."""
    return key


def query_end(key, window):
    """One past the last position whose window still shows ``key``."""
    return key + window


# ------------------------------------------------------------------------------------------------
# Host-side: Python ints


def key_range(pos: int, seq_kv: int, window: int | None, causal: bool) -> tuple[int, int]:
    """Keys ``[lo, hi)`` the query at ``pos`` sees among keys ``[0, seq_kv)`` (``lo >= hi``: none)."""
    lo = 0 if window is None else max(0, first_key(pos, window))
    hi = min(last_key(pos) + 1, seq_kv) if causal else seq_kv
    return lo, hi


def visible_pairs(seq_q: int, seq_kv: int, window: int | None = None, causal: bool = True) -> int:
    """Exact number of visible (query, key) pairs of one head and one sequence."""
    total = 0
    for r in range(seq_q):
        lo, hi = key_range(position(r, seq_q, seq_kv), seq_kv, window, causal)
        total += max(0, hi - lo)
    return total


def visible_span(seq_q: int, seq_kv: int, window: int | None) -> int:
    """Keys from the first row's first visible key to the end: every row's range lies inside (the
    keys a tile of all ``seq_q`` rows visits). Cheap: the split-KV forward asks on every launch."""
    if window is None:
        return seq_kv
    return seq_kv - max(0, first_key(position(0, seq_q, seq_kv), window))
