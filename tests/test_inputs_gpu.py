"""NaN and Inf inputs give what the reference gives.

The CPU test pins the reference's behaviour (``flashsink.attention`` on CPU tensors *is* the
reference path) against the independent gpt-oss / Hugging Face formula in float64: same NaN and
Inf positions, same finite values. The GPU tests then hold the kernels to that reference: same
NaN / Inf positions in o and lse, finite entries within the precision standard's tolerance.

Cases (B=1, H=4, H_kv=2, causal, no window, so every poisoned key is seen by the same rows in the
kernels and in the reference):

- NaN in one query row: that row of that head is NaN, nothing else moves;
- an Inf key whose scores are NaN: every row that sees it (of that key's heads) is NaN, earlier
  rows are unaffected; a key whose scores are -Inf is simply invisible: nothing changes;
- NaN in one value row: the rows that see that key (of that key's heads) are NaN in that column;
  by the formula a masked key contributes nothing, and so the reference (docs/precision.md,
  "Non-finite inputs"). The kernels may also put it in rows whose query tile visits that key's tile (0 * NaN in
  P @ V): here every row shares one tile, so the GPU test accepts NaN there;
- a NaN sink: that head is NaN; a -Inf sink: attention without a sink for that head;
- a +Inf sink (reference only: the formula's softmax gives NaN there, the reference gives the
  limit o = 0, lse = +Inf): every row puts all its weight on the sink.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.testing import PRECISIONS, check_fast, check_precision, reference_grads, tolerance

B, H, HKV, N, D = 1, 4, 2, 24, 32
SCALE = 1 / math.sqrt(D)


def _inputs(dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g)
    k = torch.randn(B, HKV, N, D, generator=g)
    v = torch.randn(B, HKV, N, D, generator=g)
    sinks = torch.randn(H, generator=g)
    return [t.to(device=device, dtype=dtype if t.dim() > 1 else torch.float32) for t in (q, k, v, sinks)]


def _poison(case, q, k, v, sinks):
    q, k, v, sinks = (t.clone() for t in (q, k, v, sinks))
    if case == "nan-q":
        q[0, 1, 5, 3] = float("nan")
    elif case == "pinf-k":
        k[0, 0, 7, :] = float("inf")  # q . k sums +Inf and -Inf terms: a NaN score for every query
    elif case == "ninf-k-score":
        # a key whose scores are -Inf for every query: no visible change at all
        k[0, 1, 9] = 0.0
        k[0, 1, 9, 0] = float("-inf")
        q[0, 2:, :, 0] = q[0, 2:, :, 0].abs() + 0.5  # heads 2, 3 use kv head 1: score = -Inf
    elif case == "nan-v":
        v[0, 1, 4, 2] = float("nan")
    elif case == "nan-sink":
        sinks[2] = float("nan")
    elif case == "ninf-sink":
        sinks[0] = float("-inf")
    elif case == "pinf-sink":
        sinks[3] = float("inf")
    else:
        raise ValueError(case)
    return q, k, v, sinks


CASES = ["nan-q", "pinf-k", "ninf-k-score", "nan-v", "nan-sink", "ninf-sink"]


def _eager64(q, k, v, sinks):
    """softmax over [scores, sink], drop the sink column (gpt-oss / Hugging Face), float64."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    mask = torch.ones(N, N, dtype=torch.bool).triu(1)
    s = s.masked_fill(mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, N, 1)
    both = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(both, dim=-1)
    p = torch.softmax(both, dim=-1)[..., :-1]
    # sum over the visible keys only (a masked key contributes nothing, whatever v holds)
    o = torch.where(~mask[..., None], p[..., None] * v[:, :, None], 0).sum(-2)
    return o, lse


def _same_nonfinite(name, actual, expected):
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.equal(a.isnan(), e.isnan()), f"{name}: NaN positions differ"
    assert torch.equal(a.isposinf(), e.isposinf()) and torch.equal(a.isneginf(), e.isneginf()), (
        f"{name}: Inf positions differ")
    return a.isfinite(), a, e


@pytest.mark.l0
@pytest.mark.parametrize("case", CASES)
def test_reference_propagates_like_the_formula(case):
    q, k, v, sinks = _poison(case, *_inputs(torch.float32))
    o, lse = flashsink.attention(q, k, v, sinks, return_lse=True)
    o_ref, lse_ref = _eager64(q, k, v, sinks)
    for name, a, e in (("o", o, o_ref), ("lse", lse, lse_ref)):
        fin, a, e = _same_nonfinite(name, a, e)
        torch.testing.assert_close(a[fin], e[fin], atol=1e-5, rtol=1e-5, msg=f"{case}: {name} finite values")
    if case in ("nan-q", "nan-sink", "nan-v", "pinf-k"):
        assert o.isnan().any(), "the poison must show"
    if case in ("ninf-k-score", "ninf-sink"):
        assert o.isfinite().all()


@pytest.mark.l0
def test_reference_pinf_sink_takes_all_weight():
    q, k, v, sinks = _poison("pinf-sink", *_inputs(torch.float32))
    o, lse = flashsink.attention(q, k, v, sinks, return_lse=True)
    assert torch.equal(o[:, 3], torch.zeros_like(o[:, 3])) and lse[:, 3].isposinf().all()
    o_ok, _ = flashsink.attention(*_inputs(torch.float32)[:3], _inputs(torch.float32)[3], return_lse=True)
    torch.testing.assert_close(o[:, :3], o_ok[:, :3])


# ----------------------------------------------------------------------------------------------
# the kernels (CUDA)

@pytest.mark.gpu
@pytest.mark.l1
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [*CASES, "pinf-sink"])
def test_kernels_match_the_reference_on_nan_inf(case, dtype):
    q, k, v, sinks = _poison(case, *_inputs(dtype))
    o_ref, lse_ref = reference.attention(q, k, v, sinks, return_lse=True, compute_dtype=torch.float64)
    qc, kc, vc, sc = (t.cuda() for t in (q, k, v, sinks))
    o, lse = flashsink.attention(qc, kc, vc, sc, return_lse=True)
    torch.cuda.synchronize()
    tol = tolerance(dtype)
    if case == "nan-v":  # the kernels' documented difference: NaN in rows sharing the key's tile
        o = torch.where(o_ref.cuda().isnan() | ~o.isnan(), o, o_ref.cuda().to(dtype))
    for name, a, e in (("o", o, o_ref.to(dtype)), ("lse", lse, lse_ref)):
        fin, a, e = _same_nonfinite(f"{case} {name}", a, e)
        torch.testing.assert_close(a[fin], e[fin], atol=tol.atol_small * 4, rtol=tol.rtol * 4,
                                   msg=f"{case}: {name} finite values")


@pytest.mark.gpu
@pytest.mark.l1
@pytest.mark.parametrize("precision", PRECISIONS)
def test_kernel_backward_survives_nan_inputs(precision):
    """Poisoned inputs give poisoned (not garbage-elsewhere) gradients and no crash: the gradients
    of the heads that never see the poison pass the mode's gate (the standard for "strict", the fast
    gate for "fast") against the float64 reference, lowp the reference in fp16."""
    q, k, v, sinks = _poison("nan-q", *_inputs(torch.float16))
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v, sinks)]
    flashsink.attention(*leaves, precision=precision).float().sum().backward()
    torch.cuda.synchronize()

    do = torch.ones_like(q)  # the gradient of .sum()
    exp, low = (reference_grads(q, k, v, sinks, do, compute_dtype=cdt) for cdt in (torch.float64, torch.float16))
    # kv head 1 (query heads 2, 3) never meets the NaN query of head 1
    for name, leaf, heads in (("dq", leaves[0], slice(2, None)), ("dk", leaves[1], 1), ("dv", leaves[2], 1)):
        a = leaf.grad[:, heads].cpu()
        assert a.isfinite().all(), f"{name}: NaN leaked into heads that never see it"
        e, lo = exp[name][:, heads], low[name][:, heads]
        if precision == "fast":
            report = check_fast(name, a, e, torch.float16, lowp=lo)
        else:
            report = check_precision(name, a, e, torch.float16, lowp=lo)
        assert report.passed, str(report)


@pytest.mark.gpu
@pytest.mark.l1
def test_kernels_nan_in_a_masked_value_stays_in_the_tiles_that_visit_it():
    """docs/precision.md, "Non-finite inputs": N=1024 causal, NaN in v of a key of the last key tile (128 wide
    on Hopper, 64 on sm_80: key 1000 is in the last tile of either). Rows whose query tile
    (``config.fwd_tiles``: 192 rows at D64 on Hopper, 128 on sm_80) never visits that key tile (causal
    tiles visit key tiles up to their own last row) are finite and match the reference; the rest either
    match or are NaN (0 * NaN in a partly visible tile)."""
    from flashsink._validate import validate_attention
    from flashsink.kernel_config import fwd_tiles
    from flashsink.ops.launch.dense import kernel_config
    from flashsink.testing import assert_precision, make_inputs

    inp = make_inputs(1, 4, 2, 1024, 1024, 64, torch.bfloat16, "cuda", seed=3)
    q, k, v, sinks = (inp[n] for n in ("q", "k", "v", "sinks"))
    v = v.clone()
    v[0, 1, 1000, 5] = float("nan")
    o = flashsink.attention(q, k, v, sinks)
    o_ref = reference.attention(q, k, v, sinks, compute_dtype=torch.float64)
    torch.cuda.synchronize()
    assert o_ref[:, :, :1000].isfinite().all() and o_ref[0, 2:, 1000:, 5].isnan().all()  # the formula
    ref_nan = o_ref.isnan()
    assert o[ref_nan].isnan().all()  # NaN wherever the formula gives it (rows that see the key)
    # the kernels' documented difference, and only that: 0 * NaN in the partly visible key tile, so
    # column 5 of the rows of the query tiles that visit key 1000's tile (from the first query tile
    # whose last row reaches that tile's first key) of the query heads of KV head 1 (heads 2 and 3)
    spec = validate_attention(q, k, v, sinks, window=None, causal=True, scale=None, layout="bhsd")
    t = fwd_tiles(kernel_config(spec, q.device, False))
    first = (1000 // t.block_n * t.block_n) // t.block_m * t.block_m
    leak = o.isnan() & ~ref_nan
    allowed = torch.zeros_like(leak)
    allowed[0, 2:, first:1000, 5] = True
    assert not (leak & ~allowed).any(), f"NaN outside the tiles that visit the key: {(leak & ~allowed).nonzero()[:5]}"
    assert o[:, :, :first].isfinite().all()
    # every other element matches the reference (the standard cannot judge NaN = NaN: set both to 0)
    skip = ref_nan | leak
    zero = torch.zeros((), dtype=o.dtype, device=o.device)
    assert_precision("o", torch.where(skip, zero, o), torch.where(skip, 0.0, o_ref), torch.bfloat16)
