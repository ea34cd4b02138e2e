"""flashsink.combine: partials over disjoint key ranges, merged with the sink applied once, equal the
unsplit attention -- forward (o, lse) and backward (q, k, v, sinks) -- in float64 to ~1e-12.

Partials are computed by the reference without sinks: on key slices with ``causal=False``, or, for
masked problems (causal, window, bottom-right alignment), by a small explicit-mask helper that keeps
each key's visibility from the unsplit problem. Also: gradcheck, non-finite sinks and NaN as the
reference gives them, fp16/bf16 partials merged in fp32, a fixed op count for any number of
partials, and partials from flashsink.attention itself (the kernels on CUDA, marked gpu; the same
test on CPU runs the reference) judged by the precision standard (``precision="strict"``) and, for
``precision="fast"``, by the fast gate.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

import flashsink
from flashsink import reference, testing

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture
def seed():
    s = random.SystemRandom().getrandbits(62)
    print(f"seed = {s}")  # shown by pytest when the test fails
    return s


# --- helpers ----------------------------------------------------------------------------------

def inputs(seed, *, b=2, h=4, hk=2, sq=9, skv=13, d=8, dv=None, layout="bhsd", dtype=F64, sinks=True):
    """Fresh random leaves (q, k, v, sinks in ``dtype``; sinks float64 for fp64) plus do and dlse."""
    x = testing.make_inputs(b, h, hk, sq, skv, d, dtype, "cpu", layout=layout, seed=seed, sinks=sinks, head_dim_v=dv)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = None
    if sinks:
        s = x["sinks"].to(F64 if dtype == F64 else torch.float32).detach().clone().requires_grad_(True)
    dlse = torch.randn(b, h, sq, generator=gen, dtype=F64)
    return q, k, v, s, x["do"], dlse


def seq_dim(layout):
    return 2 if layout == "bhsd" else 1


def take(t, idx, layout):
    """Keys ``idx`` (a list of positions) of k or v, differentiably."""
    return t.index_select(seq_dim(layout), torch.tensor(idx, dtype=torch.long))


def masked_partial(q, k, v, idx, visible, layout):
    """Partial attention (no sink) of q over keys ``idx`` with visibility ``visible[:, idx]``, in
    float64: o (layout of q) and lse ``[B, H, S_q]``, -inf / 0 where a row sees none of the keys,
    with finite gradients there."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ks = k.index_select(2, torch.tensor(idx, dtype=torch.long)).repeat_interleave(g, dim=1)
    vs = v.index_select(2, torch.tensor(idx, dtype=torch.long)).repeat_interleave(g, dim=1)
    vis = visible[:, idx]
    s = (q @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = torch.where(vis, s, torch.tensor(float("-inf"), dtype=s.dtype))
    m = s.amax(-1, keepdim=True).detach() if len(idx) else torch.zeros(s.shape[:-1] + (1,), dtype=s.dtype)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=s.dtype))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    empty = den <= 0
    den = torch.where(empty, torch.ones((), dtype=s.dtype), den)
    o = (e / den) @ vs
    lse = torch.where(empty, torch.tensor(float("-inf"), dtype=s.dtype), m + torch.log(den)).squeeze(-1)
    if layout == "bshd":
        o = o.transpose(1, 2)
    return o, lse


def partials(q, k, v, groups, layout, *, causal=False, window=None):
    """One partial per key group: reference slices when unmasked, else the explicit-mask helper."""
    outs, lses = [], []
    sq, skv = q.shape[seq_dim(layout)], k.shape[seq_dim(layout)]
    for idx in groups:
        if not causal:
            o, lse = reference.attention(
                q, take(k, idx, layout), take(v, idx, layout), None, causal=False, layout=layout, return_lse=True
            )
        else:
            visible = reference.visible_mask(sq, skv, window=window, causal=True)
            o, lse = masked_partial(q, k, v, idx, visible, layout)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def contiguous(skv, cuts):
    bounds = [0, *cuts, skv]
    return [list(range(a, c)) for a, c in zip(bounds[:-1], bounds[1:])]


def grads(o, lse, do, dlse, leaves):
    leaves = [x for x in leaves if x is not None]
    gs = torch.autograd.grad((o, lse), leaves, (do.to(o.dtype), dlse.to(lse.dtype)), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)]


def check_split(q, k, v, s, do, dlse, groups, layout, *, causal=False, window=None):
    """Split vs unsplit, forward and backward (through o and lse), in float64."""
    outs, lses = partials(q, k, v, groups, layout, causal=causal, window=window)
    o, lse = flashsink.combine(outs, lses, s, layout=layout, return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, s, causal=causal, window=window, layout=layout, return_lse=True)
    assert o.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    got = grads(o, lse, do, dlse, [q, k, v, s])
    want = grads(o_ref, lse_ref, do, dlse, [q, k, v, s])
    for name, a, e in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return o, lse


# --- split == unsplit, float64 ------------------------------------------------------------------

@pytest.mark.l0
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("cuts", [[6], [4, 9], [2, 5, 11]], ids=["2parts", "3parts", "4parts"])
def test_contiguous_split_noncausal(seed, layout, cuts):
    q, k, v, s, do, dlse = inputs(seed, layout=layout)
    check_split(q, k, v, s, do, dlse, contiguous(13, cuts), layout)


@pytest.mark.l1
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2), (4, 1)], ids=["MHA", "GQA3", "MQA"])
@pytest.mark.parametrize("n", [2, 3])
def test_interleaved_split_noncausal(seed, layout, h, hk, n):
    """Non-contiguous ranges: key j goes to partial j % n."""
    q, k, v, s, do, dlse = inputs(seed, h=h, hk=hk, skv=14, dv=5, layout=layout)
    check_split(q, k, v, s, do, dlse, [list(range(i, 14, n)) for i in range(n)], layout)


@pytest.mark.l1
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(
    "sq,skv,window,cuts",
    [(13, 13, None, [4, 9]), (5, 13, None, [3, 6, 10]), (13, 13, 4, [3, 6, 10]), (13, 13, 1, [6])],
    ids=["causal", "prefill-sq<skv", "window4", "window1"],
)
def test_contiguous_split_causal(seed, layout, sq, skv, window, cuts):
    """Masked problems: each row sees no key of some partials (early rows and later key ranges)."""
    q, k, v, s, do, dlse = inputs(seed, sq=sq, skv=skv, layout=layout)
    groups = contiguous(skv, cuts)
    outs, lses = partials(q, k, v, groups, layout, causal=True, window=window)
    assert any(torch.isneginf(lse).any() for lse in lses)  # the case this test is about
    check_split(q, k, v, s, do, dlse, groups, layout, causal=True, window=window)


@pytest.mark.boundary
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_partial_over_no_keys(seed, layout):
    """A range holding zero keys (lse -inf in every row) changes nothing."""
    q, k, v, s, do, dlse = inputs(seed, layout=layout)
    check_split(q, k, v, s, do, dlse, [[], list(range(0, 7)), [], list(range(7, 13))], layout)


@pytest.mark.boundary
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sinks", [True, False], ids=["sink", "nosink"])
def test_rows_where_all_partials_are_empty(seed, layout, sinks):
    """seq_q > seq_kv, causal: the first rows see no key in any partial. Without a sink o = 0 and
    lse = -inf there; with one, o = 0 and lse = sink. No NaN anywhere, forward or backward."""
    q, k, v, s, do, dlse = inputs(seed, sq=12, skv=7, layout=layout, sinks=sinks)
    o, lse = check_split(q, k, v, s, do, dlse, contiguous(7, [2, 5]), layout, causal=True)
    first = o[:, :, :5] if layout == "bhsd" else o[:, :5]
    assert (first == 0).all()
    if sinks:
        torch.testing.assert_close(lse[:, :, :5], s.detach().view(1, -1, 1).expand(2, -1, 5), rtol=0, atol=0)
    else:
        assert torch.isneginf(lse[:, :, :5]).all()
    assert torch.isfinite(lse[:, :, 5:]).all()


@pytest.mark.boundary
def test_all_empty_direct_gradients_are_zero(seed):
    """Every partial -inf (with NaN garbage in their o) and no sink: o = 0, lse = -inf, and the
    gradients into outs and lses are exactly zero, not NaN."""
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(1, 2, 3, 4, generator=g, dtype=F64) for _ in range(3)]
    outs[1][0, 1, 2] = float("nan")
    outs = [o.requires_grad_(True) for o in outs]
    lses = [torch.full((1, 2, 3), float("-inf"), dtype=F64, requires_grad=True) for _ in range(3)]
    o, lse = flashsink.combine(outs, lses, return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()
    gs = torch.autograd.grad((o, lse), outs + lses, (torch.randn_like(o), torch.randn_like(lse)))
    for gr in gs:
        assert (gr == 0).all()


@pytest.mark.l0
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_single_partial_applies_the_sink(seed, layout):
    """combine([o], [lse], sinks) is the attention with the sink; without sinks it is the identity."""
    q, k, v, s, do, dlse = inputs(seed, layout=layout)
    check_split(q, k, v, s, do, dlse, [list(range(13))], layout)
    o0, l0 = reference.attention(q, k, v, None, causal=False, layout=layout, return_lse=True)
    o, lse = flashsink.combine([o0], [l0], layout=layout, return_lse=True)
    torch.testing.assert_close(o, o0, **TOL)
    torch.testing.assert_close(lse, l0, **TOL)


@pytest.mark.l0
def test_public_api_partials(seed):
    """The README recipe: partials from flashsink.attention(..., None, causal=False, return_lse=True)."""
    q, k, v, s, do, dlse = inputs(seed, layout="bshd")
    outs, lses = zip(*(
        flashsink.attention(q, k[:, a:c], v[:, a:c], None, causal=False, layout="bshd", return_lse=True)
        for a, c in ((0, 5), (5, 13))
    ))
    o = flashsink.combine(list(outs), list(lses), s, layout="bshd")
    torch.testing.assert_close(o, flashsink.attention(q, k, v, s, causal=False, layout="bshd"), **TOL)


@pytest.mark.l1
def test_associative_merge(seed):
    """Merging partials step by step without the sink, then once with it (a ring), is the same."""
    q, k, v, s, do, dlse = inputs(seed)
    outs, lses = partials(q, k, v, contiguous(13, [3, 6, 10]), "bhsd")
    o_a, l_a = flashsink.combine(outs[:2], lses[:2], return_lse=True)
    o_b, l_b = flashsink.combine(outs[2:], lses[2:], return_lse=True)
    o, lse = flashsink.combine([o_a, o_b], [l_a, l_b], s, return_lse=True)
    o_ref, lse_ref = flashsink.combine(outs, lses, s, return_lse=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


@pytest.mark.l0
def test_return_lse_false_and_dtypes(seed):
    """o only by default; fp32 outs give float32 o and lse; the sink gradient comes back in its dtype."""
    q, k, v, s, do, dlse = inputs(seed, dtype=torch.float32)
    outs, lses = partials(q, k, v, contiguous(13, [6]), "bhsd")
    assert lses[0].dtype == torch.float32
    o = flashsink.combine(outs, lses, s)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
    o2, lse = flashsink.combine(outs, lses, s, return_lse=True)
    assert lse.dtype == torch.float32 and torch.equal(o, o2)
    (ds,) = torch.autograd.grad(o, [s], do)
    assert ds.dtype == torch.float32 and torch.isfinite(ds).all()
    o_ref = reference.attention(q, k, v, s, causal=False)
    testing.assert_precision("o", o, o_ref.double(), torch.float32)


# --- gradcheck, non-finite values, dtypes, op count ------------------------------------------------

INF, NAN = float("inf"), float("nan")


def random_partials(seed, n, layout, *, b=1, h=3, s=5, d=3):
    """n float64 partials (outs, lses) with -inf lses: row 0 sees no key of any partial, row 1 none
    of partial 0. Their o holds (finite) garbage there, which combine must ignore."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    outs = [torch.randn(shape, generator=g, dtype=F64) for _ in range(n)]
    lses = [torch.randn(b, h, s, generator=g, dtype=F64) * 2 for _ in range(n)]
    for lse in lses:
        lse[:, :, 0] = float("-inf")
    lses[0][:, :, 1] = float("-inf")
    return outs, lses


@pytest.mark.l1
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sinks", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("n", [1, 3])
def test_gradcheck(seed, layout, sinks, n):
    """torch.autograd.gradcheck (float64) through outs, lses and sinks, with partials that see no key
    in some rows and, without a sink, a row where every partial is empty (its lse = -inf is
    replaced by 0 before the check: gradcheck's finite differences cannot take -inf - -inf)."""
    outs, lses = random_partials(seed, n, layout)
    leaves = [x.requires_grad_(True) for x in outs + lses]
    if sinks:
        leaves.append(torch.randn(3, generator=torch.Generator().manual_seed(seed + 1), dtype=F64).requires_grad_(True))

    def f(*xs):
        o, lse = flashsink.combine(list(xs[:n]), list(xs[n:2 * n]), xs[2 * n] if sinks else None,
                                   layout=layout, return_lse=True)
        return o, torch.where(torch.isneginf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def same_values(name, actual, expected):
    """Same NaN and +-inf positions, finite values equal to 1e-12."""
    a, e = actual.detach(), expected.detach()
    assert torch.equal(a.isnan(), e.isnan()), f"{name}: NaN positions differ"
    assert torch.equal(a.isposinf(), e.isposinf()), f"{name}: +inf positions differ"
    assert torch.equal(a.isneginf(), e.isneginf()), f"{name}: -inf positions differ"
    fin = torch.isfinite(e)
    torch.testing.assert_close(a[fin], e[fin], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.boundary
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_nonfinite_sinks_as_the_reference(seed, layout):
    """Sinks (+inf, -inf, NaN, finite) applied by combine give exactly what reference.attention
    gives on the unsplit problem: o, lse and the gradients of q, k, v and sinks (through o and lse)
    have the same NaN and infinity positions and equal finite values. seq_q > seq_kv, causal: the
    first rows see no key at all, so the -inf sink leaves them o = 0, lse = -inf, without NaN."""
    q, k, v, _, do, dlse = inputs(seed, sq=12, skv=7, layout=layout)
    s = torch.tensor([INF, float("-inf"), NAN, 0.7], dtype=F64, requires_grad=True)
    outs, lses = partials(q, k, v, contiguous(7, [3]), layout, causal=True)
    o, lse = flashsink.combine(outs, lses, s, layout=layout, return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, s, causal=True, layout=layout, return_lse=True)
    got = [o, lse, *grads(o, lse, do, dlse, [q, k, v, s])]
    want = [o_ref, lse_ref, *grads(o_ref, lse_ref, do, dlse, [q, k, v, s])]
    for name, a, e in zip(("o", "lse", "dq", "dk", "dv", "dsink"), got, want):
        same_values(name, a, e)
    oh = o if layout == "bhsd" else o.transpose(1, 2)
    assert (oh[:, 0] == 0).all() and torch.isposinf(lse[:, 0]).all()  # +inf: all weight on the sink
    assert (oh[:, 1, :5] == 0).all() and torch.isneginf(lse[:, 1, :5]).all()  # -inf: no sink
    assert torch.isfinite(oh[:, 1]).all() and torch.isfinite(lse[:, 1, 5:]).all()
    assert oh[:, 2].isnan().all() and lse[:, 2].isnan().all()  # NaN: the head is NaN
    assert torch.isfinite(oh[:, 3]).all() and torch.isfinite(lse[:, 3]).all()


@pytest.mark.boundary
def test_nan_propagation(seed):
    """NaN in a partial's lse: a ValueError naming it (issue 47, item 12; tests/test_input_checks_sparse_ops_combine.py).
    NaN in a partial's o where its lse is finite: that element is NaN. NaN in a partial's o where its
    lse is -inf: ignored. Nothing else moves."""
    outs, lses = random_partials(seed, 3, "bhsd")
    s = torch.tensor([0.3, -1.0, 2.0], dtype=F64)
    base_o, base_lse = flashsink.combine(outs, lses, s, return_lse=True)
    assert torch.isfinite(base_o).all() and torch.isfinite(base_lse).all()

    def run(outs_, lses_):
        return flashsink.combine(outs_, lses_, s, return_lse=True)

    bad = [lse.clone() for lse in lses]
    bad[1][0, 1, 3] = NAN
    with pytest.raises(ValueError, match=r"lses\[1\] must hold finite values or -inf.*\[0, 1, 3\]"):
        run(outs, bad)

    bad = [x.clone() for x in outs]
    bad[2][0, 1, 3, 1] = NAN
    o, lse = run(bad, lses)
    elem = torch.zeros_like(o, dtype=torch.bool)
    elem[0, 1, 3, 1] = True
    assert o[elem].isnan().all() and torch.equal(o[~elem], base_o[~elem]) and torch.equal(lse, base_lse)

    bad = [x.clone() for x in outs]
    bad[0][:, :, :2] = NAN  # rows 0 and 1 of partial 0 saw no key
    bad[1][:, :, 0] = NAN
    o, lse = run(bad, lses)
    assert torch.equal(o, base_o) and torch.equal(lse, base_lse)
    assert (o[:, :, 0] == 0).all()  # no key anywhere, finite sink: o = 0


@pytest.mark.l0
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_low_precision_partials_merge_in_fp32(seed, dtype, layout):
    """bf16/fp16 outs are merged in float32 and cast once: bitwise what merging their float32
    copies and casting gives. Gradients come back in each input's dtype."""
    outs, lses = random_partials(seed, 3, layout)
    outs = [x.to(dtype).requires_grad_(True) for x in outs]
    lses = [x.float().requires_grad_(True) for x in lses]
    s = torch.tensor([0.3, -1.0, 2.0], requires_grad=True)
    o, lse = flashsink.combine(outs, lses, s, layout=layout, return_lse=True)
    o32, lse32 = flashsink.combine([x.float() for x in outs], lses, s, layout=layout, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(o, o32.to(dtype)) and torch.equal(lse, lse32)
    gs = torch.autograd.grad((o, lse), outs + lses + [s], (torch.randn_like(o), torch.randn_like(lse)))
    assert [g.dtype for g in gs] == [x.dtype for x in outs + lses + [s]]
    assert all(torch.isfinite(g).all() for g in gs)


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops that run (views and allocations left out): on CUDA each is about one launch."""

    SKIP = {"empty", "empty_strided", "empty_like", "detach", "scalar_tensor", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.SKIP:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.l0
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_op_count_does_not_grow_with_the_partials(seed, layout):
    """The partials are stacked once and merged by one fixed sequence of ops, forward and backward:
    2 and 9 partials run the same ops (the former loop ran ~5 more per partial, each way)."""
    counts = []
    for n in (2, 9):
        outs, lses = random_partials(seed, n, layout)
        outs = [x.float().requires_grad_(True) for x in outs]
        lses = [x.float().requires_grad_(True) for x in lses]
        s = torch.zeros(3, requires_grad=True)
        with OpCount() as fwd:
            o, lse = flashsink.combine(outs, lses, s, layout=layout, return_lse=True)
        with OpCount() as bwd:
            torch.autograd.grad((o, lse), outs + lses + [s], (torch.ones_like(o), torch.ones_like(lse)))
        counts.append((fwd.ops, bwd.ops))
    assert counts[0] == counts[1]
    assert len(counts[0][0]) <= 19, counts[0][0]


# --- low precision: judged by the precision standard against fp64 --------------------------------

LOWP = [torch.bfloat16, torch.float16]


@pytest.mark.l1
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_low_precision_outs(seed, dtype, layout):
    """bf16/fp16 partial outs (fp32 lse), as the kernels return them: the combined o (in the outs'
    dtype) and lse pass the full precision standard against the fp64 reference on the same inputs.

    The gradients through such partials carry two extra roundings (each partial's o and its
    incoming gradient are rounded to the low dtype), so they are held to gate 2 and the max-abs
    gate only: dq misses gate 1's 99% share in about half of the draws (~98.7%). Partials kept in
    fp32 meet the whole standard (next test)."""
    b, h, hk, sq, skv, d = 2, 4, 2, 48, 64, 32
    q, k, v, s, do, _ = inputs(seed, b=b, h=h, hk=hk, sq=sq, skv=skv, d=d, layout=layout, dtype=dtype)
    outs, lses = partials(q, k, v, contiguous(skv, [20, 41]), layout)
    assert outs[0].dtype == dtype and lses[0].dtype == torch.float32
    o, lse = flashsink.combine(outs, lses, s, layout=layout, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    dq, dk, dv, ds = torch.autograd.grad(o, [q, k, v, s], do)
    actual = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsink": ds}
    reports = testing.compare_all(actual, q, k, v, s, do, causal=False, layout=layout)
    failed = [str(r) for r in reports if r.name in ("o", "lse") and not r.passed]
    failed += [
        str(r) for r in reports
        if r.name not in ("o", "lse") and not (r.gate2_ok and r.gate1_max_ok and torch.isfinite(actual[r.name]).all())
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.l1
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
def test_low_precision_inputs_fp32_partials(seed, dtype):
    """bf16/fp16 q, k, v with partials kept in fp32 and the combined o cast once: o, lse and the
    gradients of q, k, v and sinks all pass the full precision standard (both gates)."""
    b, h, hk, sq, skv, d = 2, 4, 2, 48, 64, 32
    q, k, v, s, do, _ = inputs(seed, b=b, h=h, hk=hk, sq=sq, skv=skv, d=d, dtype=dtype)
    outs, lses = partials(q.float(), k.float(), v.float(), contiguous(skv, [20, 41]), "bhsd")
    o, lse = flashsink.combine(outs, lses, s, return_lse=True)
    o = o.to(dtype)
    dq, dk, dv, ds = torch.autograd.grad(o, [q, k, v, s], do)
    actual = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsink": ds}
    reports = testing.compare_all(actual, q, k, v, s, do, causal=False)
    failed = [str(r) for r in reports if not r.passed]
    assert not failed, "\n".join(failed)


# --- partials from the kernels: the GPU test and its CPU twin ------------------------------------

def kernel_partials(q, k, v, ranges, *, causal, window, attn=None):
    """One partial per key range ``[a, b)`` of a "bhsd" problem, computed as ring attention
    computes them (``flashsink.distributed``): the queries that see keys of the range are split by
    ``_plan_pair`` into pieces that are each one ``attn`` call (default ``flashsink.attention``)
    without the sink (``return_lse=True``) under the full problem's mask -- fully visible
    (``causal=False``), diagonal (``causal=True`` with the window, keys ending at the last query),
    or, with a window, rows that see only the last keys of the range (reversed rows and keys,
    bottom-right causal). Rows in no piece keep o = 0, lse = -inf. Differentiable (autograd
    through every call)."""
    from flashsink.distributed.ring import _plan_pair

    attn = attn or flashsink.attention
    b_, h, sq, _ = q.shape
    skv = k.shape[2]
    off = skv - sq  # key position of query row 0 (bottom-right alignment)
    outs, lses = [], []
    for a, b in ranges:
        o = q.new_zeros(b_, h, sq, v.shape[-1])
        lse = torch.full((b_, h, sq), float("-inf"), device=q.device)
        for q0, q1, k0, k1, kind in _plan_pair(off, skv, a, b, causal, window):
            rows = slice(q0 - off, q1 - off)
            qs, ks, vs = q[:, :, rows], k[:, :, k0:k1], v[:, :, k0:k1]
            if kind == "suffix":
                op, lp = attn(qs.flip(2), ks.flip(2), vs.flip(2), None, causal=True, return_lse=True)
                op, lp = op.flip(2), lp.flip(2)
            else:
                op, lp = attn(
                    qs, ks, vs, None, causal=kind == "causal", window=window if kind == "causal" else None,
                    return_lse=True,
                )
            o[:, :, rows] = op
            lse[:, :, rows] = lp
        outs.append(o)
        lses.append(lse)
    return outs, lses


# (batch, heads, kv_heads, seq_q, seq_kv, window, causal, cuts): 2-4 key ranges
SPLIT_CASES = {
    "causal-bottom-right": (2, 8, 2, 96, 400, None, True, [150, 330]),
    "window": (1, 8, 2, 384, 384, 64, True, [100, 230, 250]),
    "decode": (2, 8, 2, 4, 2048, None, True, [700, 1500]),  # split-KV kernel per range on Hopper
    "noncausal": (1, 12, 4, 64, 200, None, False, [77]),
}


@pytest.mark.l1
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_kernel_partials_combine_to_the_unsplit_attention(seed, device, dtype, case):
    """Keys split into 2-4 ranges, each range's partial from flashsink.attention without the sink
    (the kernels on CUDA, the reference on CPU: this test's CPU twin), merged by combine with the
    sink: the result is judged as the unsplit attention is, by the precision standard against the
    float64 reference of the unsplit problem, gate 2 against its fp16/bf16 twin. o and lse meet the
    whole standard; the gradients (q, k, v through the kernels' backward, with an lse gradient, and
    the sinks) meet gate 2 and the max-error bound, and are finite: each partial's o is rounded to
    fp16/bf16 and so is its incoming gradient (as in test_low_precision_outs). The kernels run with
    ``precision="strict"``, the mode this standard judges (fast: the next test)."""
    b, h, hk, sq, skv, window, causal, cuts = SPLIT_CASES[case]
    x = testing.make_inputs(b, h, hk, sq, skv, 64, dtype, device, seed=seed)
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = x["sinks"].clone().requires_grad_(True)
    bounds = [0, *cuts, skv]
    outs, lses = kernel_partials(q, k, v, list(zip(bounds[:-1], bounds[1:])), causal=causal, window=window,
                                 attn=functools.partial(flashsink.attention, precision="strict"))
    assert outs[0].dtype == dtype and lses[0].dtype == torch.float32
    o, lse = flashsink.combine(outs, lses, s, return_lse=True)
    assert o.dtype == dtype and o.device.type == device
    dq, dk, dv, ds = torch.autograd.grad(o, [q, k, v, s], x["do"])
    actual = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsink": ds}
    reports = testing.compare_all(actual, x["q"], x["k"], x["v"], x["sinks"], x["do"], window=window, causal=causal)
    failed = [str(r) for r in reports if r.name in ("o", "lse") and not r.passed]
    failed += [
        str(r) for r in reports
        if r.name not in ("o", "lse") and not (r.gate2_ok and r.gate1_max_ok and torch.isfinite(actual[r.name]).all())
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.l1
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernel_partials_combine_fast(seed, device):
    """The same split with ``precision="fast"`` partials (the default), bf16: o, lse and the gradients
    under the fast gate against the float64 reference of the unsplit problem, lowp the same split
    and merge with the reference computing each partial in bf16 -- so lowp carries the partials'
    extra roundings too (their o and incoming gradient rounded to bf16), and the gate asks the
    kernels' split to be no worse than PyTorch's own in bf16. One case (non-causal: a single kernel
    configuration); the CPU twin runs the reference."""
    b, h, hk, sq, skv, window, causal, cuts = SPLIT_CASES["noncausal"]
    dtype = torch.bfloat16
    x = testing.make_inputs(b, h, hk, sq, skv, 64, dtype, device, seed=seed)
    bounds = [0, *cuts, skv]

    def split_and_merge(attn):
        q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        s = x["sinks"].clone().requires_grad_(True)
        outs, lses = kernel_partials(q, k, v, list(zip(bounds[:-1], bounds[1:])), causal=causal, window=window,
                                     attn=attn)
        o, lse = flashsink.combine(outs, lses, s, return_lse=True)
        dq, dk, dv, ds = torch.autograd.grad(o, [q, k, v, s], x["do"])
        return {"o": o.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv, "dsink": ds}

    actual = split_and_merge(functools.partial(flashsink.attention, precision="fast"))
    lowp = split_and_merge(functools.partial(reference.attention, compute_dtype=dtype))
    expected = testing.reference_grads(x["q"], x["k"], x["v"], x["sinks"], x["do"], window=window, causal=causal,
                                       compute_dtype=torch.float64)
    reports = testing.judge_all(actual, expected, lowp, dtype, precision="fast")
    failed = [str(r) for r in reports if not r.passed]
    assert not failed, "\n".join(failed)


# --- validation --------------------------------------------------------------------------------

def _parts(n=2, layout="bhsd", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 5, 8) if layout == "bhsd" else (2, 5, 4, 8)
    outs = [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]
    lses = [torch.randn(2, 4, 5, generator=g) for _ in range(n)]
    return outs, lses, torch.randn(4, generator=g)


@pytest.mark.boundary
@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda o, l, s: (o[0], l, s, {}), TypeError, r"^outs must be a list or tuple"),
        (lambda o, l, s: (o, l[0], s, {}), TypeError, r"^lses must be a list or tuple"),
        (lambda o, l, s: ([], [], s, {}), ValueError, r"^outs must hold at least one"),
        (lambda o, l, s: (o, [], s, {}), ValueError, r"^lses must hold at least one"),
        (lambda o, l, s: (o, l[:1], s, {}), ValueError, r"^outs and lses must have one entry per partial"),
        (lambda o, l, s: ([o[0], o[1].tolist()], l, s, {}), TypeError, r"^outs\[1\] must be a torch.Tensor"),
        (lambda o, l, s: (o, [l[0], None], s, {}), TypeError, r"^lses\[1\] must be a torch.Tensor"),
        (lambda o, l, s: ([o[0].int(), o[1]], l, s, {}), TypeError, r"^outs\[0\] must have a floating-point dtype"),
        (lambda o, l, s: (o, [l[0], l[1].long()], s, {}), TypeError, r"^lses\[1\] must have a floating-point dtype"),
        (lambda o, l, s: ([x[0] for x in o], l, s, {}), ValueError, r"^outs\[0\] must be 4-D"),
        (lambda o, l, s: ([o[0], o[1][:, :, :4]], l, s, {}), ValueError, r"^outs\[1\] must have the shape of outs\[0\]"),
        (lambda o, l, s: ([o[0], o[1].double()], l, s, {}), ValueError, r"^outs must share one dtype"),
        (lambda o, l, s: (o, [l[0], l[1].double()], s, {}), ValueError, r"^lses must share one dtype"),
        (lambda o, l, s: (o, [l[0], l[1][:, :, :4]], s, {}), ValueError, r"^lses\[1\] must be \[B, H, S\] = \[2, 4, 5\]"),
        (lambda o, l, s: (o, [x.transpose(1, 2) for x in l], s, {}), ValueError, r"^lses\[0\] must be \[B, H, S\]"),
        (lambda o, l, s: ([o[0], o[1].to("meta")], l, s, {}), ValueError, r"^outs must be on one device"),
        (lambda o, l, s: (o, [l[0], l[1].to("meta")], s, {}), ValueError, r"^lses\[1\] must be on the device of outs"),
        (lambda o, l, s: (o, l, s.tolist(), {}), TypeError, r"^sinks must be a torch.Tensor"),
        (lambda o, l, s: (o, l, s.long(), {}), TypeError, r"^sinks must have a floating-point dtype"),
        (lambda o, l, s: (o, l, s[:3], {}), ValueError, r"^sinks must be 1-D of shape \[4\]"),
        (lambda o, l, s: (o, l, s.view(1, 4), {}), ValueError, r"^sinks must be 1-D of shape \[4\]"),
        (lambda o, l, s: (o, l, s.to("meta"), {}), ValueError, r"^sinks must be on the device of outs"),
        (lambda o, l, s: (o, l, s, {"layout": "bsdh"}), ValueError, r"^layout must be one of \('bhsd', 'bshd'\)"),
        (lambda o, l, s: (o, l, s, {"layout": None}), ValueError, r"^layout must be one of"),
        (lambda o, l, s: (o, l, s, {"return_lse": 1}), TypeError, r"^return_lse must be a bool"),
    ],
    ids=[
        "outs-not-list", "lses-not-list", "empty", "lses-empty", "length-mismatch", "outs-item-not-tensor",
        "lses-item-not-tensor", "outs-int", "lses-int", "outs-3d", "outs-shape-mismatch", "outs-dtype-mismatch",
        "lses-dtype-mismatch", "lse-shape", "lse-layout-order", "outs-device", "lses-device", "sinks-not-tensor",
        "sinks-int", "sinks-short", "sinks-2d", "sinks-device", "layout-unknown", "layout-none", "return-lse-int",
    ],
)
def test_validation(mutate, exc, pattern):
    outs, lses, sinks = _parts()
    o, l, s, kw = mutate(outs, lses, sinks)
    with pytest.raises(exc, match=pattern):
        flashsink.combine(o, l, s, **kw)


@pytest.mark.boundary
def test_validation_bshd_lse_shape():
    """In bshd, lse stays [B, H, S]: an lse in the outs' [B, S, H] order is refused."""
    outs, lses, sinks = _parts(layout="bshd")
    flashsink.combine(outs, lses, sinks, layout="bshd")  # fine
    with pytest.raises(ValueError, match=r"^lses\[0\] must be \[B, H, S\] = \[2, 4, 5\]"):
        flashsink.combine(outs, [x.transpose(1, 2) for x in lses], sinks, layout="bshd")
    with pytest.raises(ValueError, match=r"^lses\[0\] must be \[B, H, S\] = \[2, 5, 4\]"):
        flashsink.combine(outs, lses, sinks, layout="bhsd")  # outs read as [B, H=5, S=4, D]
