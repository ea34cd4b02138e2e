"""The reference, proven against an independent eager formula in float64.

The eager formula is written as gpt-oss and Hugging Face write it: repeat_kv, scores, masked_fill
with -inf, concatenate the sink as an extra column, softmax, drop the sink column, @ v. Outputs,
lse and every gradient must agree to ~1e-12.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.testing import assert_precision, case_id, make_inputs

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# The independent formula (bhsd, float64)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D], as in Hugging Face."""
    b, hk, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, hk, n_rep, s, d).reshape(b, hk * n_rep, s, d)


def eager_attention(q, k, v, sinks, *, positions, window, causal, scale):
    """q [B, H, R, D] holds the query rows at absolute ``positions`` [R]; k, v [B, H_kv, S, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    attn = torch.matmul(q, k.transpose(2, 3)) * scale
    key_pos = torch.arange(k.shape[2])
    masked = torch.zeros(len(positions), k.shape[2], dtype=torch.bool)
    if causal:
        masked |= key_pos[None, :] > positions[:, None]
    if window is not None:
        masked |= key_pos[None, :] <= positions[:, None] - window
    attn = attn.masked_fill(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(attn, dim=-1)
        return torch.matmul(probs, v), torch.logsumexp(attn, dim=-1)
    sink = sinks.to(attn.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    combined = torch.cat([attn, sink], dim=-1)
    lse = torch.logsumexp(combined, dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    scores = probs[..., :-1]
    return torch.matmul(scores, v), lse


# ---------------------------------------------------------------------------------------------


def assert_close64(name, actual, expected, rel=1e-12):
    """Plain float64 max-abs comparison; matching infinities count as equal."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).eq(torch.isfinite(e)).all(), f"{name}: non-finite pattern differs"
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    err = torch.where(same, torch.zeros_like(a), (a - e).abs())
    bound = rel * max(1.0, float(torch.where(torch.isfinite(e), e.abs(), 0).max()))
    assert float(err.max()) <= bound, f"{name}: max abs err {float(err.max()):.3e} > {bound:.1e}"


@dataclass(frozen=True)
class Case:
    b: int
    h: int
    hk: int
    sq: int
    skv: int
    d: int
    window: int | None = None
    causal: bool = True
    dv: int | None = None
    scale: float | None = None

    def id(self, layout, sinks):
        return case_id(
            batch=self.b, heads=self.h, kv_heads=self.hk, seq_q=self.sq, seq_kv=self.skv,
            head_dim=self.d, head_dim_v=self.dv, window=self.window, causal=self.causal,
            layout=layout, sinks=sinks, dtype=F64,
        ) + ("" if self.scale is None else f"-scale{self.scale}")


L0_CASES = [
    Case(1, 4, 4, 16, 16, 8),  # GQA 1
    Case(2, 6, 2, 37, 37, 16, window=5),  # GQA 3
]
L1_CASES = [
    Case(1, 8, 1, 33, 33, 16, window=1),  # GQA 8, window 1: only the diagonal
    Case(1, 16, 1, 29, 29, 8, window=100),  # GQA 16, window >= length
    Case(2, 6, 2, 20, 45, 16, window=7),  # seq_q < seq_kv: bottom-right
    Case(2, 6, 2, 45, 20, 16),  # seq_q > seq_kv: the first 25 rows see no key
    Case(2, 6, 2, 45, 20, 16, window=3),
    Case(1, 3, 1, 1, 1, 16),  # N = 1
    Case(1, 3, 1, 1, 57, 16, window=9),  # one query, long kv
    Case(2, 4, 2, 23, 31, 16, causal=False),
    Case(1, 4, 2, 19, 19, 16, window=6, dv=24),  # D_v != D
    Case(1, 4, 1, 21, 21, 16, window=11, scale=0.3),
]


def _random_cases(n, seed=1234):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hk = rng.choice([1, 2, 3])
        g = rng.choice([1, 3, 8, 16])
        sq, skv = rng.randint(1, 70), rng.randint(1, 70)
        causal = rng.random() < 0.8
        window = rng.choice([None, 1, rng.randint(2, 80)]) if causal else None
        out.append(Case(rng.randint(1, 2), hk * g, hk, sq, skv, rng.choice([8, 16, 24]), window, causal))
    return out


L2_CASES = [Case(1, 16, 4, 257, 300, 64, window=100), Case(1, 8, 8, 333, 129, 32)] + _random_cases(8)


def _params(cases, mark):
    return [
        pytest.param(c, layout, sinks, id=c.id(layout, sinks), marks=mark)
        for c in cases
        for layout in ("bhsd", "bshd")
        for sinks in (True, False)
    ]


def run_both(c: Case, layout: str, sinks: bool, seed: int):
    inp = make_inputs(c.b, c.h, c.hk, c.sq, c.skv, c.d, F64, "cpu", layout=layout, seed=seed, sinks=sinks, head_dim_v=c.dv)
    scale = c.scale if c.scale is not None else 1.0 / math.sqrt(c.d)
    names = ["q", "k", "v"] + (["sinks"] if sinks else [])
    leaves = {n: inp[n].double().requires_grad_(True) for n in names}
    do = inp["do"]

    o, lse = reference.attention(
        leaves["q"], leaves["k"], leaves["v"], leaves.get("sinks"), window=c.window, causal=c.causal,
        scale=c.scale, layout=layout, return_lse=True,
    )
    grads = dict(zip(names, torch.autograd.grad(o, list(leaves.values()), do)))

    # The eager formula, on bhsd views of fresh leaves; without sinks it only gets the rows that
    # see at least one key (its softmax of all -inf is NaN).
    eleaves = {n: inp[n].double().requires_grad_(True) for n in names}
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    eq, ek, ev = (to_bhsd(eleaves[n]) for n in ("q", "k", "v"))
    positions = torch.arange(c.sq) + (c.skv - c.sq)
    rows = (positions >= 0) if (c.causal and not sinks) else torch.ones(c.sq, dtype=torch.bool)
    eo, else_ = eager_attention(
        eq[:, :, rows], ek, ev, eleaves.get("sinks"), positions=positions[rows], window=c.window,
        causal=c.causal, scale=scale,
    )
    edo = to_bhsd(do)[:, :, rows]
    egrads = dict(zip(names, torch.autograd.grad(eo, list(eleaves.values()), edo)))
    return dict(o=to_bhsd(o), lse=lse, grads=grads, eo=eo, else_=else_, egrads=egrads, rows=rows, to_bhsd=to_bhsd)


def check_against_eager(c: Case, layout: str, sinks: bool, seed: int):
    r = run_both(c, layout, sinks, seed)
    rows, to_bhsd = r["rows"], r["to_bhsd"]
    assert r["lse"].dtype == F64 and r["lse"].shape == (c.b, c.h, c.sq)
    assert_close64("o", r["o"][:, :, rows], r["eo"])
    assert_close64("lse", r["lse"][:, :, rows], r["else_"])
    # Rows that see no key: o = 0, lse = -inf (no sink), dq = 0.
    assert torch.equal(r["o"][:, :, ~rows], torch.zeros_like(r["o"][:, :, ~rows]))
    assert torch.isneginf(r["lse"][:, :, ~rows]).all()
    for n in r["grads"]:
        g, eg = r["grads"][n], r["egrads"][n]
        assert torch.isfinite(g).all(), f"d{n} has non-finite values"
        if n == "q":
            g = to_bhsd(g)
            assert torch.equal(g[:, :, ~rows], torch.zeros_like(g[:, :, ~rows]))
            g, eg = g[:, :, rows], to_bhsd(eg)[:, :, rows]
        assert_close64(f"d{n}", g, eg)


@pytest.mark.parametrize("c, layout, sinks", _params(L0_CASES, pytest.mark.l0))
def test_reference_vs_eager_l0(c, layout, sinks):
    check_against_eager(c, layout, sinks, seed=zlib.crc32(c.id(layout, sinks).encode()))


@pytest.mark.parametrize("c, layout, sinks", _params(L1_CASES, pytest.mark.l1))
def test_reference_vs_eager_l1(c, layout, sinks):
    check_against_eager(c, layout, sinks, seed=zlib.crc32(c.id(layout, sinks).encode()))


@pytest.mark.parametrize("c, layout, sinks", _params(L2_CASES, pytest.mark.l2))
def test_reference_vs_eager_l2(c, layout, sinks):
    check_against_eager(c, layout, sinks, seed=zlib.crc32(c.id(layout, sinks).encode()))


# ---------------------------------------------------------------------------------------------
# Degenerate problems


@pytest.mark.boundary
def test_fully_masked_rows_keep_only_the_sink():
    # seq_q > seq_kv, causal: rows 0..9 have absolute positions -10..-1 and see no key.
    inp = make_inputs(2, 4, 2, 14, 4, 8, F64, "cpu", seed=11)
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks")]
    o, lse = reference.attention(*leaves, return_lse=True)
    assert torch.equal(o[:, :, :10], torch.zeros_like(o[:, :, :10]))
    assert torch.equal(lse[:, :, :10], inp["sinks"].double().view(1, 4, 1).expand(2, 4, 10))
    grads = torch.autograd.grad(o, leaves, inp["do"])
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, :, :10], torch.zeros_like(grads[0][:, :, :10]))


@pytest.mark.boundary
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_fully_masked_rows_without_sink_no_nan(dtype):
    inp = make_inputs(1, 4, 1, 9, 3, 8, dtype, "cpu", seed=12, sinks=False)
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
    o, lse = reference.attention(*leaves, return_lse=True)
    assert torch.isfinite(o).all()
    assert torch.equal(o[:, :, :6], torch.zeros_like(o[:, :, :6]))
    assert torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    # Backprop through o and lse together: still no NaN.
    loss = (o.float() * inp["do"].float()).sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
    for g in torch.autograd.grad(loss, leaves):
        assert torch.isfinite(g).all()


@pytest.mark.boundary
@pytest.mark.parametrize(
    "sq, skv", [(0, 0), (0, 5), (5, 0), (1, 1)], ids=["NQ0-NK0", "NQ0-NK5", "NQ5-NK0", "NQ1-NK1"]
)
@pytest.mark.parametrize("sinks", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_empty_and_single(sq, skv, sinks, layout):
    inp = make_inputs(2, 4, 2, sq, skv, 8, F64, "cpu", seed=13, sinks=sinks, layout=layout)
    names = ["q", "k", "v"] + (["sinks"] if sinks else [])
    leaves = [inp[n].clone().requires_grad_(True) for n in names]
    o, lse = reference.attention(*leaves[:3], leaves[3] if sinks else None, layout=layout, return_lse=True)
    assert o.shape == inp["q"].shape and lse.shape == (2, 4, sq)
    assert torch.isfinite(o).all()
    if skv == 0:
        assert torch.equal(o, torch.zeros_like(o))
        expect = inp["sinks"].view(1, 4, 1).expand(2, 4, sq).double() if sinks else torch.full((2, 4, sq), -math.inf, dtype=F64)
        assert torch.equal(lse, expect)
    grads = torch.autograd.grad(o, leaves, inp["do"], allow_unused=True)
    for x, g in zip(leaves, grads):
        assert g is None or (g.shape == x.shape and torch.isfinite(g).all())


@pytest.mark.boundary
def test_batch_and_heads_of_one():
    check_against_eager(Case(1, 1, 1, 7, 7, 8, window=3), "bhsd", True, seed=14)
    check_against_eager(Case(1, 1, 1, 7, 7, 8, window=3), "bshd", False, seed=15)


@pytest.mark.l0
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_sinks_any_float_dtype(sink_dtype):
    inp = make_inputs(2, 6, 2, 17, 17, 16, F64, "cpu", seed=16)
    sinks = inp["sinks"].to(sink_dtype)
    q, k, v = (inp[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = sinks.clone().requires_grad_(True)
    o = reference.attention(q, k, v, s, window=5)
    ds = torch.autograd.grad(o, s, inp["do"])[0]
    assert ds.dtype == sink_dtype
    # The same problem with the (exactly representable) sink values in float64.
    s64 = sinks.double().requires_grad_(True)
    o64 = reference.attention(q, k, v, s64, window=5)
    ds64 = torch.autograd.grad(o64, s64, inp["do"])[0]
    assert_close64("o", o, o64)
    assert_precision("dsink", ds, ds64, sink_dtype)


@pytest.mark.l0
def test_dtypes_of_results():
    inp = make_inputs(1, 4, 2, 9, 9, 16, torch.float16, "cpu", seed=17)
    o, lse = reference.attention(inp["q"], inp["k"], inp["v"], inp["sinks"], return_lse=True)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    o, lse = reference.attention(inp["q"], inp["k"], inp["v"], inp["sinks"], return_lse=True, compute_dtype=torch.float16)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    o, lse = reference.attention(inp["q"], inp["k"], inp["v"], inp["sinks"], return_lse=True, compute_dtype=F64)
    assert o.dtype == torch.float16 and lse.dtype == F64
    assert reference.attention(inp["q"], inp["k"], inp["v"]).shape == inp["q"].shape


# ---------------------------------------------------------------------------------------------
# Varlen


def _varlen_case(lens_q, lens_k, *, sinks, window, seed):
    gen = torch.Generator().manual_seed(seed)
    h, hk, d = 6, 2, 16
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, generator=gen, dtype=F64)
    k = torch.randn(tk, hk, d, generator=gen, dtype=F64)
    v = torch.randn(tk, hk, d, generator=gen, dtype=F64)
    do = torch.randn(tq, h, d, generator=gen, dtype=F64)
    s = torch.rand(h, generator=gen, dtype=torch.float32) * 4 - 2 if sinks else None
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0)
    return q, k, v, s, do, cu_q, cu_k


@pytest.mark.parametrize(
    "lens_q, lens_k, window",
    [
        ([5, 0, 1, 17, 9], [5, 3, 1, 17, 30], 4),
        ([1, 1, 1], [1, 1, 1], None),
        ([12, 40], [30, 7], None),  # both directions of seq_q != seq_kv
        ([0, 0], [0, 4], 2),
    ],
    ids=["mixed-W4", "ones", "uneven", "empty"],
)
@pytest.mark.parametrize("sinks", [True, False], ids=["sink", "nosink"])
@pytest.mark.l1
def test_varlen_equals_per_sequence(lens_q, lens_k, window, sinks):
    q, k, v, s, do, cu_q, cu_k = _varlen_case(lens_q, lens_k, sinks=sinks, window=window, seed=18)
    names = ["q", "k", "v"] + (["s"] if sinks else [])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s) if t is not None]
    o, lse = reference.attention_varlen(
        *leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), leaves[3] if sinks else None,
        window=window, return_lse=True,
    )
    assert o.shape == q.shape and lse.shape == (6, q.shape[0])
    grads = torch.autograd.grad(o, leaves, do)

    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s) if t is not None]
    outs, lses = [], []
    for i in range(len(lens_q)):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        c, e = int(cu_k[i]), int(cu_k[i + 1])
        oi, li = reference.attention(
            ref_leaves[0][a:b][None], ref_leaves[1][c:e][None], ref_leaves[2][c:e][None],
            ref_leaves[3] if sinks else None, window=window, layout="bshd", return_lse=True,
        )
        outs.append(oi[0])
        lses.append(li[0])
    ro, rl = torch.cat(outs), torch.cat(lses, dim=1)
    rgrads = torch.autograd.grad(ro, ref_leaves, do, allow_unused=True)
    assert_close64("o", o, ro)
    assert_close64("lse", lse, rl)
    for n, g, rg in zip(names, grads, rgrads):
        assert torch.isfinite(g).all()
        assert_close64(f"d{n}", g, torch.zeros_like(g) if rg is None else rg)


@pytest.mark.l0
def test_varlen_api_cpu_matches_reference():
    q, k, v, s, do, cu_q, cu_k = _varlen_case([3, 8], [3, 10], sinks=True, window=3, seed=19)
    o1, l1 = flashsink.attention_varlen(q, k, v, cu_q, cu_k, 8, 10, s, window=3, return_lse=True)
    o2, l2 = reference.attention_varlen(q, k, v, cu_q, cu_k, 8, 10, s, window=3, return_lse=True)
    assert_close64("o", o1, o2)
    assert_close64("lse", l1, l2)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs (docs/precision.md, "Non-finite inputs"): a masked key contributes nothing, by the formula.


def test_nan_in_a_value_no_row_sees_stays_out():
    # the case: 2 keys, 4 queries (bottom-right causal: rows 0, 1 see no key, row 2 key 0)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    clean = reference.attention(q, k, v, return_lse=True)
    v[0, 0, 1, 0] = float("nan")
    o, lse = reference.attention(q, k, v, return_lse=True)
    assert torch.equal(o[..., :3, :], clean[0][..., :3, :]) and torch.equal(lse, clean[1])
    assert (o[..., :2, :] == 0).all()  # rows that see no key: o = 0, as the formula says
    assert torch.isnan(o[0, 0, 3, 0]) and torch.equal(o[0, 0, 3, 1:], clean[0][0, 0, 3, 1:])


def test_window_1_nan_in_the_last_value_row():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    clean = reference.attention(q, k, v, sinks, window=1)
    v[0, :, -1] = float("nan")
    o = reference.attention(q, k, v, sinks, window=1)
    assert torch.equal(o[..., :-1, :], clean[..., :-1, :])
    assert torch.isnan(o[..., -1, :]).all()


def _nan_case(where: str, seed: int):
    """A causal window-3 GQA problem with one non-finite entry, and the rows it reaches."""
    g = torch.Generator().manual_seed(seed)
    b, h, hk, n, d = 1, 4, 2, 10, 8
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hk, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    visible = reference.visible_mask(n, n, window=3, causal=True)
    bad = {"q": (q, (0, 1, 6, 2)), "k": (k, (0, 0, 6, 5)), "v": (v, (0, 1, 7, 3))}[where]
    rows = visible[:, bad[1][2]] if where != "q" else torch.arange(n) == bad[1][2]
    return (q, k, v, sinks), bad, rows, visible


@pytest.mark.parametrize("where, value", [("q", math.nan), ("k", math.nan), ("v", math.nan), ("v", math.inf),
                                          ("v", -math.inf)], ids=["q-nan", "k-nan", "v-nan", "v-inf", "v--inf"])
@pytest.mark.parametrize("path", ["reference", "op"])
def test_non_finite_reaches_only_the_rows_that_see_it(where, value, path):
    """Rows that see no non-finite entry, and keys that only such rows see, get exactly the results of
    the same problem with the entry finite: forward and backward, the autograd reference and the
    custom op's closed-form backward (flashsink::fwd / bwd on the CPU)."""
    inputs, (tensor, index), reached, visible = _nan_case(where, seed=11)
    do = torch.randn(1, 4, 10, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(args):
        leaves = [x.clone().requires_grad_(True) for x in args]
        if path == "op":
            o, lse = torch.ops.flashsink.fwd(*leaves, 3, True, 8 ** -0.5, "bhsd", False)
            lse = lse[..., :10]
        else:
            o, lse = reference.attention(*leaves, window=3, return_lse=True)
        return (o, lse, *torch.autograd.grad(o, leaves, do))

    clean = run(inputs)
    tensor[index] = value
    got = run(inputs)
    ok_rows = ~reached  # rows of q, o, lse
    ok_keys = ~(visible & reached[:, None]).any(0)  # keys no reached row sees
    assert reached.any() and ok_rows.any() and ok_keys.any()
    checked = [("o", got[0], clean[0], 2, ok_rows), ("lse", got[1], clean[1], 2, ok_rows)]
    if path == "op" or where == "v":  # the autograd reference's gradients for non-finite q / k: unspecified
        checked += [("dq", got[2], clean[2], 2, ok_rows), ("dk", got[3], clean[3], 2, ok_keys),
                    ("dv", got[4], clean[4], 2, ok_keys)]
    for name, a, e, dim, ok in checked:
        assert_close64(name, a.index_select(dim, ok.nonzero()[:, 0]), e.index_select(dim, ok.nonzero()[:, 0]))
    # the rows that see it: o and lse NaN (a v entry: its column of o)
    row = index[2]
    if where == "v":
        heads = slice(2 * index[1], 2 * index[1] + 2)  # both query heads of the KV head
        assert torch.isnan(got[0][0, heads, reached, index[3]]).all()
        assert_close64("lse", got[1][0, heads][:, reached], clean[1][0, heads][:, reached])
    elif where == "k":
        heads = slice(2 * index[1], 2 * index[1] + 2)
        assert torch.isnan(got[1][0, heads][:, reached]).all()
    else:
        assert torch.isnan(got[1][0, index[1], row]) and torch.isnan(got[0][0, index[1], row]).all()
