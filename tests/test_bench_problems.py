"""bench/problems.py: exact pair counts (against the reference mask and brute force over packed batches),
the FLOP and byte formulas, the presets and `--shape`."""

from __future__ import annotations

import pytest
import torch

from flashsink import bench
from flashsink.reference import visible_mask

pytestmark = pytest.mark.l1


@pytest.mark.parametrize(
    "sq,skv,window,causal",
    [
        (64, 64, None, True), (64, 64, 16, True), (64, 64, 1, True), (64, 64, 200, True),
        (17, 64, None, True), (17, 64, 8, True), (64, 17, None, True), (64, 17, 5, True),
        (33, 50, None, False), (1, 100, 7, True), (100, 1, None, True),
    ],
)
def test_visible_pairs_match_mask(sq, skv, window, causal):
    expected = int(visible_mask(sq, skv, window=window, causal=causal).sum())
    assert bench.visible_pairs(sq, skv, window, causal) == expected


def test_flops_and_bytes():
    p = bench.Problem("t", 2, 8, 2, 128, 128, 64, None, "bf16")
    pairs = 2 * 8 * (128 * 129 // 2)
    assert bench.flops(p, "fwd") == 4 * pairs * 64
    assert bench.flops(p, "bwd") == 10 * pairs * 64
    assert bench.flops(p, "fwd+bwd") == 14 * pairs * 64
    q = 2 * 8 * 128 * 64 * 2
    kv = 2 * 2 * 128 * 64 * 2
    assert bench.min_bytes(p, "fwd") == 2 * q + 2 * kv  # q, k, v in; o out
    assert bench.min_bytes(p, "bwd") == 3 * q + 4 * kv  # q, k, v, do in; dq, dk, dv out
    assert bench.min_bytes(p, "fwd+bwd") == 4 * q + 4 * kv
    # golden: the windowed preset is bound by bytes, not FLOPs, at the ceilings
    g = bench.preset_problems("golden")[0]
    t_flops = bench.flops(g, "fwd") / 709e12
    t_bytes = bench.min_bytes(g, "fwd") / 4.22e12
    assert t_bytes > t_flops
    assert abs(t_bytes * 1e3 - 0.036) < 0.002  # the floor for golden fwd


def test_presets_and_shape():
    assert set(bench.PRESETS) == {"golden", "gptoss-swa", "gptoss-full", "causal-d128", "varlen", "decode", "hf-train",
                                  "decode-paged", "gptoss-stack-4k", "gptoss-stack-16k"}
    assert set(bench.TINY_PRESETS) == set(bench.PRESETS)
    g = bench.preset_problems("golden")[0]
    assert (g.dtype, g.batch, g.heads, g.kv_heads, g.seq_q, g.head_dim, g.window) == ("fp16", 1, 64, 8, 4096, 128, 128)
    assert [p.seq_q for p in bench.preset_problems("gptoss-full")] == [2048, 4096, 8192, 16384]
    p = bench.parse_shape("1,4,2,64:96,32,16", "bf16")
    assert (p.seq_q, p.seq_kv, p.window, p.dtype) == (64, 96, 16, "bf16")
    assert bench.parse_shape("1,4,2,64,32", "fp16").window is None
    with pytest.raises(ValueError):
        bench.parse_shape("1,4,2", "fp16")


def _brute_pairs_varlen(seqlens, window, causal):
    """Visible pairs over the packed [T, T] grid: same sequence, causal / window on the packed positions."""
    doc = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens, dtype=torch.long))
    i = torch.arange(len(doc)).unsqueeze(1)
    j = torch.arange(len(doc)).unsqueeze(0)
    keep = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    return int(keep.sum())


def _brute_bytes(inp, o_shape, mode):
    """Bytes of the tensors each mode must read and write, summed from the real tensors."""
    def nb(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    o = torch.empty(o_shape, dtype=q.dtype)
    fwd = nb(q, k, v) + nb(o)
    bwd = nb(q, k, v, do) + nb(q, k, v)  # dq, dk, dv are shaped like q, k, v
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": bwd + nb(o)}[mode]


@pytest.mark.parametrize("window,causal", [(None, True), (1, True), (4, True), (13, True), (1000, True),
                                           (None, False)])
def test_varlen_flops_and_bytes_brute_force(window, causal):
    lens = (0, 1, 7, 20, 3, 0, 33)  # empty sequences and a single token on purpose
    p = bench.Problem("t", len(lens), 6, 2, max(lens), max(lens), 16, window, "bf16", causal, seqlens=lens)
    pairs = _brute_pairs_varlen(lens, window, causal)
    assert bench.problem_pairs(p) == pairs
    inp = bench.make_problem_inputs(p, "cpu", seed=0)
    assert inp["q"].shape == (sum(lens), 6, 16) and inp["k"].shape == (sum(lens), 2, 16)
    assert inp["cu_seqlens"].tolist() == [0, 0, 1, 8, 28, 31, 31, 64] and inp["max_seqlen"] == 33
    for mode in bench.MODES:
        assert bench.flops(p, mode) == bench.FLOP_FACTOR[mode] * 6 * pairs * 16
        assert bench.min_bytes(p, mode) == _brute_bytes(inp, inp["q"].shape, mode)


@pytest.mark.parametrize("seq_kv,window", [(37, None), (37, 5), (1, None), (300, 299)])
def test_decode_flops_and_bytes_brute_force(seq_kv, window):
    p = bench.Problem("t", 3, 4, 2, 1, seq_kv, 16, window, "bf16", forward_only=True)
    pairs = 3 * int(visible_mask(1, seq_kv, window=window, causal=True).sum())
    assert bench.problem_pairs(p) == pairs
    assert pairs == 3 * (seq_kv if window is None else min(window, seq_kv))  # the last row sees the cache tail
    inp = bench.make_problem_inputs(p, "cpu", seed=0)
    assert bench.flops(p, "fwd") == 4 * 4 * pairs * 16
    assert bench.min_bytes(p, "fwd") == _brute_bytes(inp, inp["q"].shape, "fwd")
    assert p.n == seq_kv and p.kind == "decode"


def test_varlen_and_decode_presets():
    a, b = bench.preset_problems("varlen")
    assert (a.window, b.window) == (128, None) and a.causal and b.causal
    assert a.seqlens == b.seqlens and len(a.seqlens) == 64 and sum(a.seqlens) == 32768 and min(a.seqlens) >= 1
    assert (a.dtype, a.heads, a.kv_heads, a.head_dim, a.batch) == ("bf16", 64, 8, 64, 64)
    assert a.seq_q == a.seq_kv == max(a.seqlens) and a.n == 32768
    assert bench.preset_problems("varlen")[0].seqlens == a.seqlens  # a fixed seed: every run packs the same batch
    assert bench.lengths_summary(a.seqlens) == "10/384/2590"  # pinned: docs/bench.md quotes it, runs stay comparable
    assert bench.lengths_summary(a.seqlens) in a.label()
    dec = bench.preset_problems("decode")
    assert [p.seq_kv for p in dec] == [4096, 16384, 65536]
    assert all(p.seq_q == 1 and p.batch == 8 and p.forward_only and p.causal and p.dtype == "bf16" for p in dec)
    # decode moves the whole cache for a few FLOPs: bound by bytes at the ceilings
    for p in dec:
        assert bench.min_bytes(p, "fwd") / 4.22e12 > 20 * bench.flops(p, "fwd") / 709e12
    for name in bench.PRESETS:  # every preset has a CPU version of the same kind
        big, small = bench.preset_problems(name), bench.preset_problems(name, tiny=True)
        assert {p.kind for p in big} == {p.kind for p in small} and len(small) >= 1
    lens = bench.varlen_lengths(5, 12, seed=1)
    assert len(lens) == 5 and sum(lens) == 12 and min(lens) >= 1
    with pytest.raises(ValueError):
        bench.varlen_lengths(13, 12)
