"""The tile schedule: which (sequence, tile) a program works on, for every layout.

A kernel over row tiles (query tiles in the forward, the preprocess and the deterministic dQ; KV
tiles in the main backward) launches ``grid(...)`` programs along its first and last grid dims and
asks :func:`locate` which sequence and which tile of it a program has.

- Padded layouts (bhsd, bshd): ``ceil(seq / block)`` tiles x ``batch`` sequences; program
  ``(bx, .., bz)`` is tile ``bx`` of sequence ``bz``.
- Packed (thd): one program per tile that exists, plus at most one per sequence that does nothing,
  with no host sync and no tensor beyond ``cu_seqlens``. Sequence ``b`` owns the program slots
  ``[slot(b), slot(b + 1))`` with

      slot(b) = cu[b] // block + b

  and runs its ``ceil(len_b / block)`` tiles in the first of them. That many fit: with
  ``cu[b] = a * block + r`` (``r < block``), ``slot(b + 1) - slot(b) = (r + len_b) // block + 1``,
  which is ``ceil(len_b / block)`` or one more, so the slots are disjoint, every tile has one and a
  sequence leaves at most one slot idle. The grid is ``slot(n_seqs) = total // block + n_seqs``
  (total tokens and the number of sequences: shapes the host knows). A program finds its sequence
  by binary search over ``slot`` (strictly increasing in ``b``): ``ceil(log2(n_seqs))`` loads of
  ``cu_seqlens``, which every program reads anyway. Its tile index is ``p - slot(b)``; the idle
  slot's tile starts at or past the end of its sequence, which every kernel already treats as a
  tile with no rows (an empty key range, nothing stored).

Why not a prefix sum of tiles per sequence computed by the host with torch ops (FlashAttention's
way, ``cumsum(ceil(len / block))``) and searched the same way: it costs as many loads, a few torch
calls per launch (5-15 us each on the H200's host, docs/perf-log.md), a tensor more in every packed
kernel's signature, and its grid is the same upper bound (the host cannot know the exact count
without a sync), so it leaves as many programs idle.

tests/test_schedule.py checks the slots against a brute-force list of tiles, and this module's
search, compiled for the CPU, against Python's ``bisect`` over the slots.
"""

import tilelang.language as T


def grid(layout: str, seq, n_cu, batch, block: int):
    """``(tiles, runs)``: the grid's first dim (tiles along the sequences; thd: the program slots)
    and its last (sequences; thd: 1). ``seq``: the padded length, or (thd) the packed rows."""
    if layout == "thd":
        return seq // block + (n_cu - 1), 1
    return T.ceildiv(seq, block), batch


def locate(layout: str, cu, bx, bz, block: int):
    """``(b, tile)``: the sequence and the tile index within it of program ``(bx, .., bz)`` of a
    :func:`grid` of ``block``-row tiles; ``cu``: the cu_seqlens of the rows tiled (thd)."""
    if layout == "thd":
        return _search(cu, bx, block)
    return bz, bx


def slot(cu, b, block):
    """The first program slot of packed sequence ``b`` (module docstring)."""
    return cu[b] // block + b


@T.macro
def _search(cu, p, block: int):
    """The last sequence ``b`` with ``slot(b) <= p``, and ``p - slot(b)``: ``lo`` and ``hi`` bracket
    it (``slot(lo) <= p < slot(hi)``, ``slot(n_seqs)`` being the grid)."""
    lo = T.alloc_var("int32", init=0)
    hi = T.alloc_var("int32", init=cu.shape[0] - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if slot(cu, mid, block) <= p:
            lo = mid
        else:
            hi = mid
    return lo, p - slot(cu, lo, block)


def persistent_tile(cta, step, n_ctas, snake: bool = True):
    """The tile a persistent program ``cta`` of ``n_ctas`` works on at its ``step``-th turn: the tiles go
    out in rounds of ``n_ctas``, one per program; ``snake`` (boustrophedon) reverses every other round,
    so the program that took a round's first tile takes the next round's last. Without it, program
    ``cta`` takes ``cta, cta + n_ctas, ..`` (round-robin).

    Why: the forward's tiles are issued longest first (causal query tiles, ``fwd_ws._locate``), so under
    round-robin the first programs take the longest tile of every round. A model of the persistent
    forward (each program's time the sum of its tiles' KV tiles, tests/test_schedule.py) puts the
    slowest program at 1.062x the mean under round-robin and 1.000x with the snake for causal D128
    N4096 (2,048 tiles of 128 rows on 132 programs), 1.044x against 1.001x for gpt-oss full D64 N8192
    (2,736 packed tiles of 24 positions); the grid ends with its slowest program. Tiles of equal work
    (windows, no mask) are unaffected.

    Plain arithmetic, so the same function runs on Python ints (the tests) and in a kernel."""
    return step * n_ctas + _place(cta, step, n_ctas, snake)


def persistent_steps(cta, total, n_ctas, snake: bool = True):
    """How many turns program ``cta`` of :func:`persistent_tile`'s ``n_ctas`` (at most ``total``) takes
    over ``total`` tiles: every full round's, and the last round's where its place in that round is
    below the round's ``total % n_ctas`` tiles."""
    pos = _place(cta, total // n_ctas, n_ctas, snake)  # its place in the round that may be partial
    return (total - pos + n_ctas - 1) // n_ctas


def _place(cta, step, n_ctas, snake: bool):
    """Program ``cta``'s place in round ``step`` of :func:`persistent_tile`."""
    return cta + (step % 2) * (n_ctas - 1 - 2 * cta) if snake else cta


def by_work(p, n_tiles, heads, longest_last: bool, lpt: bool = True):
    """``(tile, head)`` of program ``p`` of a grid of ``n_tiles * heads`` programs along its first dim,
    issued longest first: the GPU hands programs out in launch order as SMs free up (greedy list
    scheduling), so the programs with the most work go first and the short ones fill the tail.

    Causal work shrinks with the KV tile (the main backward: each KV tile is seen by the rows from its
    own on) and grows with the query tile (``longest_last``: a query tile sees the keys up to its
    rows); windowed and non-causal tiles cost the same, so the order only matters for causal problems.
    The heads of one tile are consecutive.

    Order ``(tile, head)`` instead of the launch's natural ``(head, tile)`` (each head's tiles in a
    row, a sawtooth of long and short): for the causal main backward at N=4096, 32 KV tiles x 8 KV
    heads = 256 programs on 132 SMs, a greedy simulation gives a makespan 1.59x the ideal in the old
    order and 1.00x in this one, and the H200 measured 1.56x with the mask branch (docs/perf-log.md v10).

    Used by the hand warp-specialized main backward (``bwd_ws.py``), which places its syncs by hand.
    TileLang's pipelined kernels keep the launch order: this index arithmetic misleads TileLang
    0.1.15's automatic sync placement (wrong gradients or a compile error, docs/perf-log.md v10); there
    :func:`grid_dims` and :func:`grid_coords` take the same order from the grid's own layout instead
    (``bwd.build_bwd(swap=True)``, the strict preprocess's ``lpt``).

    ``lpt=False`` gives the old order, each head's tiles in a row (tools/bwd_variants.py times both).
    """
    if not lpt:
        return p % n_tiles, p // n_tiles
    t = p // heads
    return (n_tiles - 1 - t if longest_last else t), p % heads


def grid_dims(n_tiles, heads, on: bool):
    """The first two extents of a grid over (tile, head) whose programs :func:`grid_coords` places:
    ``on``, heads along x and tiles along y; off, the launch order (tiles along x). For TileLang's
    pipelined kernels, which take :func:`by_work`'s order from the grid's own layout (no index
    arithmetic on a flat program id, which misleads TileLang 0.1.15's sync placement)."""
    return (heads, n_tiles) if on else (n_tiles, heads)


def grid_coords(gx, gy, n_tiles, longest_last: bool, on: bool):
    """``(tile, head)`` of the program at ``(gx, gy)`` of a :func:`grid_dims` grid. ``on``: the GPU hands
    programs out x fastest, so every head's longest tile goes first (``longest_last``: the tiles counted
    from the last, the causal query tiles that see the most keys)."""
    if not on:
        return gx, gy
    return (n_tiles - 1 - gy if longest_last else gy), gx
