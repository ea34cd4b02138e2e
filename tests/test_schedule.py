"""The packed (thd) tile schedule of ``ops/tir/schedule.py``: which (sequence, tile) each program runs.

The slots (``schedule.slot``, searched with Python's ``bisect``) against a brute-force list of
tiles (random lengths with 0 and 1 among them, up to thousands of sequences); then the kernels' own
TIR of the search, compiled for the CPU (TileLang's C target), against that for every program
index; then that every packed kernel launches the schedule's grid and searches, and no padded
kernel does. No GPU.
"""

import bisect
import math
import random
import re

import pytest

pytest.importorskip("tilelang")

import torch  # noqa: E402

from flashsink.ops.tir import schedule  # noqa: E402
from flashsink.ops.compiler.compile import build_prim_func  # noqa: E402
from flashsink.kernel_config import KernelConfig, bwd_ws, fwd_tiles, fwd_ws, pack_gqa_fits  # noqa: E402

pytestmark = pytest.mark.l0


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _lengths():
    """(name, lengths): edge cases and random batches with empty and one-token sequences."""
    rng = random.Random(11)
    cases = [("one", [1]), ("empty", [0]), ("zeros", [0, 0, 0]), ("exact", [128, 256, 64]),
             ("boundaries", [127, 1, 128, 129, 0, 255, 257]), ("long", [0, 1, 16384, 5, 700])]
    for n, hi in ((7, 300), (64, 1000), (300, 40), (3000, 200), (3000, 3)):
        cases.append((f"random-{n}x{hi}", [rng.choice([0, 1, rng.randint(0, hi)]) for _ in range(n)]))
    return cases


def _grid(cu, block):
    """The thd grid's program slots (``schedule.grid``): ``total // block + n_seqs``."""
    return cu[-1] // block + len(cu) - 1


def _programs(cu, block):
    """``(b, tile)`` of every program of the grid: the last sequence whose first slot
    (``schedule.slot``) is at most the program's index, found by ``bisect`` (the kernels search by
    hand)."""
    slots = [schedule.slot(cu, b, block) for b in range(len(cu) - 1)]
    found = [bisect.bisect_right(slots, p) - 1 for p in range(_grid(cu, block))]
    return [(b, p - slots[b]) for p, b in enumerate(found)]


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("name,lens", _lengths(), ids=[c[0] for c in _lengths()])
def test_every_tile_runs_once_and_few_programs_idle(name, lens, block):
    cu = _cu(lens)
    tiles = [(b, j) for b, n in enumerate(lens) for j in range(math.ceil(n / block))]
    progs = _programs(cu, block)
    real = [(b, j) for b, j in progs if j * block < lens[b]]
    idle = [(b, j) for b, j in progs if j * block >= lens[b]]
    assert real == tiles  # each tile exactly once, in packed order
    assert len(idle) <= len(lens)
    assert len({b for b, _ in idle}) == len(idle)  # at most one idle program per sequence
    # an idle program's tile is the first past its sequence's end: an empty tile to every kernel
    assert all(j == math.ceil(lens[b] / block) for b, j in idle)
    assert all(0 <= b < len(lens) for b, _ in progs)


def test_grid_is_the_bound_of_the_brief():
    """The grid is ``total // block + n_seqs``: at most the real tiles plus one per sequence."""
    rng = random.Random(3)
    for _ in range(200):
        lens = [rng.randint(0, 500) for _ in range(rng.randint(1, 50))]
        block = rng.choice([32, 64, 128])
        real = sum(math.ceil(n / block) for n in lens)
        grid = _grid(_cu(lens), block)
        assert real <= grid <= real + len(lens)


@pytest.fixture(scope="module")
def search_kernel():
    """``schedule.locate`` for thd inside a kernel compiled for the CPU: writes ``(b, tile)`` of
    every program. The same macro the CUDA kernels inline."""
    import tilelang
    import tilelang.language as T
    from tilelang.language.kernel import Kernel

    n_cu, n_prog = T.dynamic("n_cu, n_prog")

    def build(block):
        @T.prim_func
        def search(Cu: T.Tensor([n_cu], "int32"), Out: T.Tensor([n_prog, 2], "int32")):
            with Kernel(n_prog) as p:
                b, j = schedule.locate("thd", Cu, p, 0, block)
                Out[p, 0] = b
                Out[p, 1] = j

        try:
            return tilelang.compile(search, target="c")
        except Exception as exc:  # no host C compiler: the Python twin above still runs
            pytest.skip(f"TileLang's C target does not build here: {type(exc).__name__}: {exc}")

    return {block: build(block) for block in (64, 128)}


@pytest.mark.parametrize("block", [64, 128])
def test_kernel_search_is_the_host_arithmetic(search_kernel, block):
    for name, lens in _lengths():
        cu = _cu(lens)
        n = _grid(cu, block)
        out = torch.full((n, 2), -7, dtype=torch.int32)
        search_kernel[block](torch.tensor(cu, dtype=torch.int32), out)
        assert out.tolist() == [list(x) for x in _programs(cu, block)], name


def _cfg(layout, precision="fast", deterministic=False, arch="sm_90a", groups=8):
    return KernelConfig(arch, "bfloat16", 64, 64, groups, True, True, layout, deterministic, precision)


#: the kinds whose programs take their tiles longest first (``schedule.by_work``): the ws main
#: backward (fast, Hopper); the grid is (tiles x heads, sequences)
BY_WORK = ("bwd", "bwd_split")

KINDS = [("fwd", {}), ("preprocess", {}), ("preprocess", {"precision": "strict"}), ("bwd", {}),
         ("bwd", {"precision": "strict"}), ("bwd_split", {}), ("dq", {"deterministic": True}),
         ("fwd", {"arch": "sm_80"}), ("bwd", {"arch": "sm_80"})]


@pytest.mark.parametrize("kind,over", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values())) or 'default'}"
                                                  for k, o in KINDS])
def test_packed_kernels_launch_the_schedule(kind, over):
    """thd: the grid's first dim is the program slots (``rows // block + n_seqs``; times the heads in
    the kernels that issue their tiles longest first, ``schedule.by_work``), its last is 1, and the
    program searches ``cu_seqlens``; bhsd: tiles (x heads) x batch, no search. The Hopper forward
    (``fwd_ws.py``'s persistent kernel) loops over the same slots (x heads) from a grid of its own,
    and searches for each."""
    cfg = _cfg("thd", **over)
    text = build_prim_func(kind, cfg).script()
    assert "while " in text
    if kind == "fwd" and fwd_ws(cfg):
        # the slots it loops over: tiles of block_m positions, or at head dim 64 (a GQA group packed into
        # one tile, config.pack_gqa_fits) of block_m / groups positions: 192 / 8
        bm = fwd_tiles(cfg).block_m
        rows = bm // cfg.groups if pack_gqa_fits(cfg, bm) else bm
        assert rows == 24 and f"m_tiles: T.int32 = seq_q // {rows} + (n_cu - 1)" in text
        return
    by_work = kind in BY_WORK and bwd_ws(cfg)
    last = "blockIdx.y" if by_work else "blockIdx.z"
    assert f"T.thread_binding(1, thread=\"{last}\")" in text
    assert re.search(r"\b(seq_q|seq_kv) // (64|128) \+ \(n_cu - 1\)", text)  # the grid's program slots
    if by_work:  # slots x heads along x, heads fastest
        assert re.search(r'T.thread_binding\((m_tiles|n_tiles) \* .*thread="blockIdx.x"\)', text)
        assert 'thread="blockIdx.z"' not in text
    padded = build_prim_func(kind, _cfg("bhsd", **over)).script()
    assert "while " not in padded and f"T.thread_binding(1, thread=\"{last}\")" not in padded


@pytest.mark.parametrize("n_tiles, heads", [(1, 1), (5, 3), (32, 8), (7, 64)])
@pytest.mark.parametrize("longest_last", [False, True])
def test_by_work_issues_every_tile_once_longest_first(n_tiles, heads, longest_last):
    """``by_work`` (the ws main backward's launch order) maps the flat grid onto every (tile, head)
    exactly once, the heads of a tile consecutive and the tiles in the order of their work: ascending
    (KV tiles: the first has the most rows) or, ``longest_last``, descending (query tiles); with
    ``lpt=False`` the launch order of the 3D grid it replaced (each head's tiles in a row)."""
    order = [tuple(map(int, schedule.by_work(p, n_tiles, heads, longest_last))) for p in range(n_tiles * heads)]
    assert sorted(order) == [(t, h) for t in range(n_tiles) for h in range(heads)]
    tiles = [t for t, _ in order]
    assert tiles == sorted(tiles, reverse=longest_last)
    assert [h for _, h in order[:heads]] == list(range(heads))
    launch = [tuple(map(int, schedule.by_work(p, n_tiles, heads, longest_last, lpt=False)))
              for p in range(n_tiles * heads)]
    assert launch == [(t, h) for h in range(heads) for t in range(n_tiles)]


@pytest.mark.parametrize("n_tiles, heads", [(1, 1), (5, 3), (32, 8)])
@pytest.mark.parametrize("longest_last", [False, True])
@pytest.mark.parametrize("on", [False, True])
def test_grid_order_is_by_works_from_the_grids_layout(n_tiles, heads, longest_last, on):
    """``grid_dims``/``grid_coords`` (TileLang's pipelined kernels): the programs in the GPU's hand-out
    order (x fastest) reach every (tile, head) once, in ``by_work``'s order with ``on``, else in the
    launch order (``by_work(lpt=False)``)."""
    gx, gy = schedule.grid_dims(n_tiles, heads, on)
    order = [schedule.grid_coords(x, y, n_tiles, longest_last, on) for y in range(gy) for x in range(gx)]
    want = [tuple(map(int, schedule.by_work(p, n_tiles, heads, longest_last, lpt=on))) for p in range(n_tiles * heads)]
    assert order == want


@pytest.mark.parametrize("snake", [True, False])
@pytest.mark.parametrize("total, n_ctas", [(1, 1), (5, 5), (7, 3), (8, 4), (132, 132), (264, 132), (2048, 132),
                                           (2736, 132), (2111, 132), (2123, 132), (1000, 7)])
def test_persistent_programs_take_every_tile_once(total, n_ctas, snake):
    """``persistent_tile`` over ``persistent_steps`` turns of each of ``n_ctas`` programs (``fwd_ws.py``'s
    persistent loop) reaches every tile of ``total`` exactly once, one tile of each round per program, the
    rounds in order; the snake reverses every other round."""
    taken = {c: [schedule.persistent_tile(c, s, n_ctas, snake)
                 for s in range(schedule.persistent_steps(c, total, n_ctas, snake))] for c in range(n_ctas)}
    flat = [t for ts in taken.values() for t in ts]
    assert sorted(flat) == list(range(total))
    for c, ts in taken.items():
        assert [t // n_ctas for t in ts] == list(range(len(ts)))  # turn s is in round s
        if len(ts) > 1:
            assert ts[1] - n_ctas == (n_ctas - 1 - c if snake else c)


def _causal_loads(rows: int, seq: int, units: int, bn: int, snake: bool, n_ctas: int = 132):
    """Each persistent program's work in KV tiles, tiles issued as ``fwd_ws._locate`` issues causal row
    tiles (the last row tile, the one that sees the most keys, first; the ``units`` heads of a row tile
    consecutive)."""
    m_tiles = math.ceil(seq / rows)
    total = m_tiles * units

    def work(i):
        r = m_tiles - 1 - i // units
        return math.ceil(min(seq, (r + 1) * rows) / bn)

    return [sum(work(schedule.persistent_tile(c, s, n_ctas, snake))
                for s in range(schedule.persistent_steps(c, total, n_ctas, snake))) for c in range(n_ctas)]


@pytest.mark.parametrize("rows, seq, units", [(128, 4096, 64), (24, 8192, 8), (16, 4096, 8)],
                         ids=["causal-d128-n4096", "gptoss-full-d64-n8192-packed", "d128-n4096-packed"])
def test_snake_balances_the_causal_forward(rows, seq, units):
    """The grid lasts as long as its busiest program. On gpt-oss's causal problems round-robin leaves the
    first programs 4-6% above the mean; the snake keeps every program within 1% of it."""
    rr = _causal_loads(rows, seq, units, 128, snake=False)
    sn = _causal_loads(rows, seq, units, 128, snake=True)
    assert sum(rr) == sum(sn)
    mean = sum(sn) / len(sn)
    assert max(rr) / mean > 1.04
    assert max(sn) / mean < 1.01
