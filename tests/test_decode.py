"""Split-KV decode (``flashsink.ops.launch.decode``): when it is chosen, how many splits, and the merge of
the partials, on the CPU against the reference (the GPU tests run the kernel itself)."""

from dataclasses import replace

import pytest
import torch

from flashsink import reference
from flashsink._validate import validate_attention
from flashsink.kernel_config import KernelConfig
from flashsink.ops.launch.decode import n_splits_for, use_split
from flashsink.testing import check_precision
from gpu_cases import combine_splits


def _spec(b=1, h=64, hk=8, sq=1, skv=4096, window=None, layout="bhsd"):
    q = torch.empty(b, h, sq, 64) if layout == "bhsd" else torch.empty(b, sq, h, 64)
    k = torch.empty(b, hk, skv, 64) if layout == "bhsd" else torch.empty(b, skv, hk, 64)
    return validate_attention(q, k, k, None, window=window, causal=True, scale=None, layout=layout)


def _cfg(groups=8, layout="bhsd"):
    return KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=groups,
                        causal=True, has_sinks=True, layout=layout, deterministic=False, precision="strict")


@pytest.mark.l0
def test_split_is_chosen_for_decode_only():
    assert use_split(_spec(), _cfg())  # one row per head, 4k keys
    assert use_split(_spec(sq=8), _cfg())  # 8 heads x 8 rows = one 64-row tile
    assert not use_split(_spec(sq=9), _cfg())  # 72 rows do not fit
    assert not use_split(_spec(skv=300), _cfg())  # short cache: the regular kernel
    assert not use_split(_spec(window=128), _cfg())  # a window leaves few keys per row
    assert not use_split(replace(_spec(), layout="thd"), _cfg(layout="thd"))
    assert not use_split(_spec(), replace(_cfg(), arch="sm_80"))  # Hopper-only kernel


@pytest.mark.l0
def test_split_count_fills_the_gpu_with_enough_work_each():
    assert n_splits_for(_spec(b=1), _cfg(), 132) == 8  # 8 groups: 264 programs wanted, 32 blocks / 4
    assert n_splits_for(_spec(b=1, skv=65536), _cfg(), 132) == 33
    assert n_splits_for(_spec(b=64, skv=65536), _cfg(), 132) == 1  # 512 programs already
    assert n_splits_for(_spec(skv=600), _cfg(), 132) == 1


@pytest.mark.l1
@pytest.mark.parametrize("sinks", [True, False])
def test_combine_splits_equals_unsplit(sinks):
    """Partials over disjoint key ranges (one of them empty) merge into the full result."""
    g = torch.Generator().manual_seed(11)
    B, H, Hk, Sq, S, D = 2, 8, 2, 3, 700, 32
    q = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) * 2 if sinks else None
    want_o, want_lse = reference.attention(q, k, v, s, causal=False, return_lse=True)
    cuts = [0, 100, 100, 450, 700]  # the second range is empty
    o_parts, lse_parts = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            o_parts.append(torch.zeros(B, H, Sq, D, dtype=torch.float64))
            lse_parts.append(torch.full((B, H, Sq), float("-inf"), dtype=torch.float64))
            continue
        o, lse = reference.attention(q, k[:, :, a:b], v[:, :, a:b], None, causal=False, return_lse=True)
        o_parts.append(o)
        lse_parts.append(lse)
    o, lse = combine_splits(torch.stack(o_parts, dim=3), torch.stack(lse_parts, dim=3),
                            None if s is None else s, sinks)
    for name, got, want in (("o", o, want_o), ("lse", lse, want_lse)):
        rep = check_precision(name, got.float(), want, torch.float32)
        assert rep.passed, rep.row()


def _split_partials(q, k, v, cuts):
    """Kernel-layout partials ``[B, H, Sq, S, D]`` / ``[B, H, Sq, S]`` over key ranges from the
    reference without sinks; an empty range has lse -inf and NaN in its o (ignored)."""
    o_parts, lse_parts = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            o_parts.append(torch.full_like(q, float("nan")))
            lse_parts.append(torch.full(q.shape[:3], float("-inf"), dtype=q.dtype))
            continue
        o, lse = reference.attention(q, k[:, :, a:b], v[:, :, a:b], None, causal=False, return_lse=True)
        o_parts.append(o)
        lse_parts.append(lse)
    return torch.stack(o_parts, dim=3), torch.stack(lse_parts, dim=3)


def _problem(dtype=torch.float64, seed=5):
    g = torch.Generator().manual_seed(seed)
    B, H, Hk, Sq, S, D = 2, 4, 2, 3, 90, 16
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    return q, k, v, [0, 20, 20, 65, 90]


@pytest.mark.l0
@pytest.mark.parametrize("sinks", [True, False])
def test_combine_splits_is_flashsink_combine(sinks):
    """One implementation: the decode merge and flashsink.combine agree bitwise on the same partials."""
    import flashsink

    q, k, v, cuts = _problem(torch.float32)
    o_part, lse_part = _split_partials(q, k, v, cuts)
    s = torch.tensor([0.5, -1.0, 2.0, 0.0]) if sinks else None
    o, lse = combine_splits(o_part, lse_part, s, sinks)
    o2, lse2 = flashsink.combine(list(o_part.unbind(3)), list(lse_part.unbind(3)), s, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.boundary
def test_combine_splits_nonfinite_as_the_reference():
    """Sinks +inf, -inf, NaN and finite, an empty split holding NaN: o and lse as the reference
    gives them for the unsplit problem (same NaN / inf positions, finite values to 1e-12). A +inf
    sink takes all the weight (o = 0, lse = +inf), a -inf sink is no sink, a NaN sink makes its
    head NaN. Rows where every split is empty: o = 0 and lse = the sink, or -inf without one."""
    q, k, v, cuts = _problem()
    o_part, lse_part = _split_partials(q, k, v, cuts)
    s = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.7], dtype=torch.float64)
    o, lse = combine_splits(o_part, lse_part, s, True)
    want_o, want_lse = reference.attention(q, k, v, s, causal=False, return_lse=True)
    for name, got, want in (("o", o, want_o), ("lse", lse, want_lse)):
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isposinf(), want.isposinf()), name
        fin = want.isfinite()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-12, atol=1e-12)
    assert (o[:, 0] == 0).all() and lse[:, 0].isposinf().all() and o[:, 2].isnan().all()

    empty = torch.full_like(lse_part, float("-inf"))
    garbage = torch.full_like(o_part, float("nan"))
    s = torch.tensor([0.5, -1.0, float("-inf"), 0.0], dtype=torch.float64)
    o, lse = combine_splits(garbage, empty, s, True)
    assert (o == 0).all()
    assert torch.equal(lse, s.view(1, -1, 1).expand_as(lse))
    o, lse = combine_splits(garbage, empty, None, False)
    assert (o == 0).all() and lse.isneginf().all()


@pytest.mark.l0
def test_combine_splits_op_count():
    """A fixed sequence of ops for any number of splits, and fewer than before: the cat of the sink
    column and merge_stacked's 14 (the former merge ran a logsumexp, itself about 9 launches on
    CUDA, then 7 more)."""
    from test_combine import OpCount

    counts = []
    for S in (2, 33):
        g = torch.Generator().manual_seed(S)
        o_part = torch.randn(1, 64, 1, S, 64, generator=g)
        lse_part = torch.randn(1, 64, 1, S, generator=g)
        sinks = torch.zeros(64)
        with OpCount() as c:
            combine_splits(o_part, lse_part, sinks, True)
        counts.append(c.ops)
    assert counts[0] == counts[1]
    assert len(counts[0]) <= 15 and "logsumexp" not in counts[0], counts[0]
