"""The kernels' mask and block-range arithmetic (``flashsink.ops.mask`` / ``block_range``), proven
on the CPU against the reference's mask: the expressions the kernels are built from constant-fold
to integers when given integers, so no GPU is needed.

Coverage is what correctness needs (every block holding a visible pair is visited); "no visited
block is wholly masked" is what makes a windowed layer cost N*W, not N^2.
"""

import random

import pytest
import torch

from flashsink.ops.block_range import full_kv_blocks_for_rows, kv_blocks_for_rows, row_blocks_for_keys
from flashsink.ops.config import NO_WINDOW
from flashsink.ops.mask import visible
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
    """The forward skips the mask on ``[flo, fhi)``: every pair there must be visible (else a
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
