"""Packed variable-length batches (`flashsink.attention_varlen`) through the kernels on a CUDA GPU,
against the float64 varlen reference, in both precision modes: ``precision="strict"`` under the
precision standard, ``precision="fast"`` under the fast gate (as tests/test_kernels_gpu.py).

Lengths are random, with 0 and 1 among them; there are cases with a 16k sequence, with 2000
sequences, with fewer and more queries than keys per sequence (bottom-right per sequence), decode
rows, lengths at the tile edges of the packed schedule (ops/tir/schedule.py) and a loose max_seqlen.
Outputs are poisoned with NaN by conftest, so a row a kernel never writes fails.
"""

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.testing import PRECISIONS, judge_all

from gpu_cases import VarlenCase, varlen_cases

pytestmark = pytest.mark.gpu


def _cu(lens, device):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return cu.to(device)


def make_varlen(c, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(c.lens_q), sum(c.lk)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(c.dtype)

    inp = {
        "q": rnd(tq, c.heads, c.head_dim),
        "k": rnd(tk, c.kv_heads, c.head_dim),
        "v": rnd(tk, c.kv_heads, c.head_dim),
        "do": rnd(tq, c.heads, c.head_dim),
        "sinks": (torch.rand(c.heads, generator=g, device="cuda") * 4 - 2) if c.sinks else None,
        "cu_q": _cu(c.lens_q, "cuda"),
        "cu_k": _cu(c.lk, "cuda"),
        "max_q": max(c.lens_q, default=0),
        "max_k": max(c.lk, default=0),
    }
    return inp


def run(c, inp, *, api=flashsink.attention_varlen, compute_dtype=None, deterministic=None, precision=None):
    cdt = compute_dtype
    leaves = {n: (inp[n] if cdt is None else inp[n].to(cdt)).detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    if inp["sinks"] is not None:
        leaves["sinks"] = (inp["sinks"] if cdt is None else inp["sinks"].to(cdt)).detach().clone().requires_grad_(True)
    kw = dict(window=c.window, causal=c.causal, return_lse=True)
    if deterministic is not None:
        kw["deterministic"] = deterministic
    if cdt is not None:
        kw["compute_dtype"] = cdt
    if precision is not None:
        kw["precision"] = precision
    o, lse = api(
        leaves["q"], leaves["k"], leaves["v"], inp["cu_q"], inp["cu_k"], inp["max_q"], inp["max_k"],
        leaves.get("sinks"), **kw,
    )
    do = inp["do"] if cdt is None else inp["do"].to(cdt)
    grads = torch.autograd.grad(o, list(leaves.values()), do.to(o.dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves.values(), grads)]
    named = dict(zip(leaves, grads))
    return {"o": o.detach(), "lse": lse.detach(), "dq": named["q"], "dk": named["k"], "dv": named["v"],
            "dsink": named.get("sinks")}


_LAST: list = []  # [(case, inputs, references)]: the two modes of a case run back to back on the same inputs


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def references(c, inp):
    """The float64 varlen reference and the same in the case's dtype (outputs and gradients), reused
    when the case and its inputs are those of the previous call (the 2000-sequence case loops in Python)."""
    if _LAST and _LAST[0][0] == c and all(_same(_LAST[0][1][n], inp[n]) for n in inp):
        return _LAST[0][2]
    refs = (run(c, inp, api=reference.attention_varlen, compute_dtype=torch.float64),
            run(c, inp, api=reference.attention_varlen, compute_dtype=c.dtype))
    _LAST[:] = [(c, inp, refs)]
    return refs


def check_varlen(c, actual, inp, precision):
    """Every tensor (dsink only with sinks) under the gate of ``precision``."""
    expected, lowp = references(c, inp)
    reports = judge_all(actual, expected, lowp, c.dtype, precision=precision)
    failed = [r for r in reports if not r.passed]
    assert not failed, f"{precision} gate failed\n" + reports[0].header() + "\n" + "\n".join(r.row() for r in reports)


@pytest.mark.l1
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("c", varlen_cases(), ids=lambda c: c.name)
def test_varlen(c, precision):
    inp = make_varlen(c)
    actual = run(c, inp, deterministic=c.deterministic, precision=precision)
    check_varlen(c, actual, inp, precision)
    if c.deterministic:
        again = run(c, inp, deterministic=True, precision=precision)
        for n in actual:
            if actual[n] is not None:
                assert torch.equal(actual[n], again[n]), f"{n} differs between two deterministic runs"


@pytest.mark.l1
def test_varlen_matches_padded_kernels():
    """One packed sequence is the bshd problem: the two kernel paths run the same tiles in the
    same order, so o agrees to the bit."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 257, 8, 64, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, 257, 2, 64, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(1, 257, 2, 64, generator=g, device="cuda").to(torch.bfloat16)
    s = torch.randn(8, generator=g, device="cuda")
    dense = flashsink.attention(q, k, v, s, layout="bshd", window=100)
    cu = torch.tensor([0, 257], dtype=torch.int32, device="cuda")
    packed = flashsink.attention_varlen(q[0], k[0], v[0], cu, cu, 257, 257, s, window=100)
    assert torch.equal(dense[0], packed)


@pytest.mark.l1
@pytest.mark.parametrize("precision", PRECISIONS)
def test_varlen_loose_max_seqlen(precision):
    """max_seqlen_q/k far above every sequence (allowed: a bound): the kernels' grids come from the
    shapes (ops/tir/schedule.py), so o and lse are bitwise those of the tight bound; the backward may
    pick its split main kernel from the loose bound (fast, GQA: here it does) and must still pass."""
    c = VarlenCase(8, 2, 64, torch.bfloat16, tuple(range(1, 700, 37)) + (0, 128, 64), name="loose-max")
    inp = make_varlen(c, seed=5)
    tight = run(c, inp, precision=precision)
    loose = run(c, dict(inp, max_q=8 * inp["max_q"] + 3, max_k=8 * inp["max_k"] + 3), precision=precision)
    assert torch.equal(tight["o"], loose["o"]) and torch.equal(tight["lse"], loose["lse"])
    check_varlen(c, loose, inp, precision)
    check_varlen(c, tight, inp, precision)


@pytest.mark.l2
def test_varlen_no_recompile():
    """New lengths and a new number of sequences reuse the compiled kernels."""
    from flashsink.ops.compiler.registry import cache_size

    g = torch.Generator().manual_seed(7)
    sizes = []
    for i in range(12):
        n = int(torch.randint(1, 40, (1,), generator=g))
        lens = tuple(int(x) for x in torch.randint(0, 300, (n,), generator=g))
        if sum(lens) == 0:
            lens = lens + (5,)
        cu = _cu(lens, "cuda")
        q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        s = torch.randn(8, device="cuda", requires_grad=True)
        o = flashsink.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), s, window=50)
        o.float().square().sum().backward()
        sizes.append(cache_size())
    assert len(set(sizes[1:])) == 1, f"kernels compiled per call: {sizes}"
