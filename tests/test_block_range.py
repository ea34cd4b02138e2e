"""The visibility convention (``flashsink.visibility``) proven against the README's definition written
out pair by pair, then the kernels' mask and block-range arithmetic (``flashsink.ops.tir.mask`` /
``block_range``, built from its primitives) proven on the CPU against the reference's mask: the
expressions the kernels are built from constant-fold to integers when given integers, and their
symbolic (TIR) form evaluates to the same values, so no GPU is needed.

Coverage is what correctness needs (every block holding a visible pair is visited); "no visited
block is wholly masked" is what makes a windowed layer cost N*W, not N^2.
"""

import random

import pytest
import torch

from flashsink import visibility
from flashsink.ops.tir.block_range import (full_kv_blocks_for_rows, full_row_blocks_for_keys, kv_blocks_for_rows,
                                       row_blocks_for_keys)
from flashsink.kernel_config import NO_WINDOW
from flashsink.ops.tir.mask import visible
from flashsink.reference import visible_mask


def _cases(n):
    rng = random.Random(1234)
    out = [(1, 1, None), (17, 17, 1), (128, 128, 128), (100, 1000, None), (300, 200, 50), (1, 777, None),
           (129, 4096, 64), (1000, 1000, 100), (64, 64, 1000)]
    for _ in range(n):
        sq, skv = rng.randint(1, 700), rng.randint(1, 700)
        w = rng.choice([None, 1, 2, rng.randint(1, 300), 10_000])
        out.append((sq, skv, w))
    return out


def _int(x):
    return int(x)


def _readme_mask(seq_q, seq_kv, window, causal):
    """README, "Conventions", pair by pair: row r is at i = r + seq_kv - seq_q; causal keys j <= i,
    a window W keeps keys j >= i - W + 1."""
    out = torch.zeros(seq_q, seq_kv, dtype=torch.bool)
    for r in range(seq_q):
        i = r + seq_kv - seq_q
        for j in range(seq_kv):
            out[r, j] = (not causal or j <= i) and (window is None or j >= i - window + 1)
    return out


_SMALL = [(1, 1), (5, 5), (3, 9), (9, 3), (12, 12), (0, 4), (4, 0)]


@pytest.mark.l0
@pytest.mark.parametrize("seq_q, seq_kv", _SMALL)
@pytest.mark.parametrize("window, causal", [(None, True), (None, False), (1, True), (3, True), (20, True), (3, False)])
def test_visibility_is_the_readme_convention(seq_q, seq_kv, window, causal):
    """The reference's mask, each row's key range, the pair count and the split-KV span."""
    want = _readme_mask(seq_q, seq_kv, window, causal)
    assert torch.equal(visible_mask(seq_q, seq_kv, window=window, causal=causal), want)
    assert visibility.visible_pairs(seq_q, seq_kv, window, causal) == int(want.sum())
    for r in range(seq_q):
        lo, hi = visibility.key_range(visibility.position(r, seq_q, seq_kv), seq_kv, window, causal)
        assert want[r].tolist() == [lo <= j < hi for j in range(seq_kv)], (r, lo, hi)
    if seq_q and causal:  # the keys the split-KV tile of all rows visits: every visible one, from the first
        span = visibility.visible_span(seq_q, seq_kv, window)
        seen = want.any(dim=0).nonzero().flatten().tolist()
        assert span == (seq_kv - seen[0] if seen else 0)


@pytest.mark.l0
@pytest.mark.parametrize("window", [1, 2, 7, NO_WINDOW])
def test_primitives_invert_each_other(window):
    """Rows between first_query(j) and query_end(j, W) are exactly the positions whose keys
    [first_key, last_key] hold j (what row_blocks_for_keys and ring planning rely on)."""
    for j in range(-3, 30):
        for i in range(-3, 40):
            sees = visibility.first_key(i, window) <= j <= visibility.last_key(i)
            assert sees == (visibility.first_query(j) <= i < visibility.query_end(j, window)), (i, j)
            assert sees == (j <= visibility.last_key(i) and j > visibility.window_edge(i, window))
    for r in range(-2, 9):
        assert visibility.row_at(visibility.position(r, 5, 11), 5, 11) == r


@pytest.mark.l1
@pytest.mark.parametrize("seq_q, seq_kv, window", [(5, 5, 2), (3, 9, 4), (9, 3, 1), (7, 7, NO_WINDOW)])
def test_symbolic_mask_and_ranges_match(seq_q, seq_kv, window):
    """The TIR the kernels hold (mask and block ranges over symbolic row, key, lengths and window)
    evaluates, value by value, to what the integer path (judged above and below) gives."""
    import tilelang  # noqa: F401  (sets up its TVM)
    from tvm import arith
    from tvm import tirx as tir

    row, key, sq, skv, w, start = (tir.Var(n, "int32") for n in ("row", "key", "sq", "skv", "w", "start"))
    ana = arith.Analyzer()

    def value(expr):  # the simplifier folds all but the masks' bitwise_and of two bools
        if isinstance(expr, tir.Call) and expr.op.name.endswith(".bitwise_and"):
            return value(expr.args[0]) & value(expr.args[1])
        return int(ana.simplify(expr))

    def at(expr, **vals):
        return value(tir.stmt_functor.substitute(expr, {v: tir.IntImm("int32", vals[v.name])
                                                         for v in (row, key, sq, skv, w, start) if v.name in vals}))

    mask = visible(row, key, sq, skv, w, True)
    for r in range(seq_q + 2):
        for j in range(seq_kv + 2):
            want = bool(visible(r, j, seq_q, seq_kv, window, True))
            assert bool(at(mask, row=r, key=j, sq=seq_q, skv=seq_kv, w=window)) == want, (r, j)
    kv = kv_blocks_for_rows(start, 4, 2, sq, skv, w, True)
    for r0 in range(0, seq_q + 5, 4):
        want = tuple(map(_int, kv_blocks_for_rows(r0, 4, 2, seq_q, seq_kv, window, True)))
        assert tuple(at(e, start=r0, sq=seq_q, skv=seq_kv, w=window) for e in kv) == want, r0
    rows = row_blocks_for_keys(start, 2, 4, sq, skv, w, True)
    for k0 in range(0, seq_kv + 3, 2):
        want = tuple(map(_int, row_blocks_for_keys(k0, 2, 4, seq_q, seq_kv, window, True)))
        assert tuple(at(e, start=k0, sq=seq_q, skv=seq_kv, w=window) for e in rows) == want, k0


@pytest.mark.l1
@pytest.mark.parametrize(
    "seq_q, seq_kv, window, causal",
    [c + (True,) for c in _cases(25)] + [c[:2] + (None, False) for c in _cases(25) if c[2] is None],
)
def test_mask_matches_reference(seq_q, seq_kv, window, causal):
    w = NO_WINDOW if window is None else window
    ref = visible_mask(seq_q, seq_kv, window=window, causal=causal)
    # one padded tile past each end: rows/keys outside the sequence are never visible
    got = torch.tensor(
        [[bool(visible(r, j, seq_q, seq_kv, w, causal)) for j in range(seq_kv + 3)] for r in range(seq_q + 3)]
    )
    assert torch.equal(got[:seq_q, :seq_kv], ref)
    assert not got[seq_q:].any() and not got[:, seq_kv:].any()


@pytest.mark.l1
@pytest.mark.parametrize("seq_q, seq_kv, window", _cases(25))
@pytest.mark.parametrize("block_m, block_n", [(128, 128), (64, 128), (128, 64), (32, 64)])
def test_block_ranges_cover_exactly_the_visible_blocks(seq_q, seq_kv, window, block_m, block_n):
    w = NO_WINDOW if window is None else window
    vis = visible_mask(seq_q, seq_kv, window=window, causal=True)
    n_m, n_n = -(-seq_q // block_m), -(-seq_kv // block_n)
    blocks = torch.zeros(n_m, n_n, dtype=torch.bool)  # [query tile, key tile] holds a visible pair
    for i in range(n_m):
        for j in range(n_n):
            blocks[i, j] = vis[i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n].any()
    for i in range(n_m):  # forward / preprocess / dq: KV tiles of query tile i
        lo, hi = map(_int, kv_blocks_for_rows(i * block_m, block_m, block_n, seq_q, seq_kv, w, True))
        want = blocks[i].nonzero().flatten().tolist()
        assert 0 <= lo <= hi <= n_n
        assert all(lo <= j < hi for j in want), (i, lo, hi, want)
        assert all(blocks[i, j] for j in range(lo, hi)), f"query tile {i} visits a wholly masked KV tile"
    for j in range(n_n):  # main backward: query tiles of KV tile j
        lo, hi = map(_int, row_blocks_for_keys(j * block_n, block_n, block_m, seq_q, seq_kv, w, True))
        want = blocks[:, j].nonzero().flatten().tolist()
        assert 0 <= lo <= hi <= n_m
        assert all(lo <= i < hi for i in want), (j, lo, hi, want)
        assert all(blocks[i, j] for i in range(lo, hi)), f"KV tile {j} visits a wholly masked query tile"


@pytest.mark.l1
@pytest.mark.parametrize(
    "seq_q, seq_kv, window, causal",
    [c + (True,) for c in _cases(25)] + [c[:2] + (None, False) for c in _cases(25) if c[2] is None],
)
@pytest.mark.parametrize("block_m, block_n", [(128, 128), (64, 128), (128, 64), (32, 64)])
def test_full_ranges_are_exactly_the_wholly_visible_blocks(seq_q, seq_kv, window, causal, block_m, block_n):
    """The forward (and the main backward, over row blocks) skips the mask on ``[flo, fhi)``: every pair there must be visible (else a
    masked key leaks in), and every other visited block must hold a masked pair or a row or key
    past the end (the split then costs nothing where a tile could go unmasked)."""
    w = NO_WINDOW if window is None else window
    vis = visible_mask(seq_q, seq_kv, window=window, causal=causal)
    n_m, n_n = -(-seq_q // block_m), -(-seq_kv // block_n)
    for i in range(n_m + 2):  # and tiles past the end
        lo, hi = map(_int, kv_blocks_for_rows(i * block_m, block_m, block_n, seq_q, seq_kv, w, causal))
        flo, fhi = map(_int, full_kv_blocks_for_rows(lo, hi, i * block_m, block_m, block_n, seq_q, seq_kv, w, causal))
        assert lo <= flo <= fhi <= hi, (i, lo, flo, fhi, hi)
        rows_in = (i + 1) * block_m <= seq_q
        want = [j for j in range(n_n) if rows_in and (j + 1) * block_n <= seq_kv
                and vis[i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n].all()]
        assert want == list(range(flo, fhi)), (i, flo, fhi, want)
    for j in range(n_n + 2):  # the main backward's: query-row blocks of KV tile j (and tiles past the end)
        lo, hi = map(_int, row_blocks_for_keys(j * block_n, block_n, block_m, seq_q, seq_kv, w, causal))
        flo, fhi = map(_int, full_row_blocks_for_keys(lo, hi, j * block_n, block_n, block_m, seq_q, seq_kv, w, causal))
        assert lo <= flo <= fhi <= hi, (j, lo, flo, fhi, hi)
        keys_in = (j + 1) * block_n <= seq_kv
        want = [i for i in range(n_m) if keys_in and (i + 1) * block_m <= seq_q
                and vis[i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n].all()]
        assert want == list(range(flo, fhi)), (j, flo, fhi, want)


@pytest.mark.l0
def test_non_causal_visits_everything():
    assert tuple(map(_int, kv_blocks_for_rows(0, 64, 64, 100, 1000, NO_WINDOW, False))) == (0, 16)
    assert tuple(map(_int, row_blocks_for_keys(0, 64, 64, 100, 1000, NO_WINDOW, False))) == (0, 2)


@pytest.mark.l0
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_kv, window", [(1, 1, None), (100, 1000, None), (300, 200, 50), (0, 64, None), (64, 0, 10)])
def test_tiles_past_the_end_visit_nothing(seq_q, seq_kv, window, causal):
    """Varlen grids are sized for the longest sequence: a shorter sequence's tiles that start
    past its end must get an empty range (they would read another sequence's rows)."""
    w = NO_WINDOW if window is None else window
    for start in (seq_q, seq_q + 1, seq_q + 128, seq_q + 5000):
        lo, hi = map(_int, kv_blocks_for_rows(start, 128, 64, seq_q, seq_kv, w, causal))
        assert lo == hi, (start, lo, hi)
    for start in (seq_kv, seq_kv + 1, seq_kv + 64, seq_kv + 5000):
        lo, hi = map(_int, row_blocks_for_keys(start, 64, 128, seq_q, seq_kv, w, causal))
        assert lo == hi, (start, lo, hi)
