"""flashsink.attention off CUDA is the reference, judged by the precision standard."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flashsink
from flashsink import testing

CASES = [
    # b, h, hk, sq, skv, d, window, causal, layout
    (1, 4, 2, 33, 33, 16, 8, True, "bhsd"),
    (2, 6, 2, 17, 40, 32, None, True, "bshd"),
    (1, 8, 1, 45, 20, 16, 5, True, "bhsd"),  # rows that see only the sink
    (2, 3, 3, 19, 23, 16, None, False, "bshd"),
]


def _ids():
    return [
        testing.case_id(batch=b, heads=h, kv_heads=hk, seq_q=sq, seq_kv=skv, head_dim=d, window=w, causal=c, layout=lay, dtype=dt)
        for (b, h, hk, sq, skv, d, w, c, lay) in CASES
        for dt in (torch.float16, torch.bfloat16, torch.float32)
    ]


@pytest.mark.l0
@pytest.mark.parametrize(
    "case, dtype",
    [(c, dt) for c in CASES for dt in (torch.float16, torch.bfloat16, torch.float32)],
    ids=_ids(),
)
def test_cpu_fallback_matches_reference(case, dtype):
    b, h, hk, sq, skv, d, window, causal, layout = case
    inp = testing.make_inputs(b, h, hk, sq, skv, d, dtype, "cpu", layout=layout, seed=sq * 1000 + skv)
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks")]
    o, lse = flashsink.attention(*leaves, window=window, causal=causal, layout=layout, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    dq, dk, dv, ds = torch.autograd.grad(o, leaves, inp["do"])
    actual = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, dsink=ds)
    reports = testing.compare_all(actual, **inp, window=window, causal=causal, layout=layout)
    assert [r.name for r in reports] == ["o", "lse", "dq", "dk", "dv", "dsink"]
    failed = [r for r in reports if not r.passed]
    assert not failed, "\n".join([testing.PrecisionReport.header()] + [r.row() for r in reports])


@pytest.mark.l0
def test_without_sinks_and_no_lse():
    inp = testing.make_inputs(1, 4, 2, 12, 12, 16, torch.float16, "cpu", seed=5, sinks=False)
    o = flashsink.attention(inp["q"], inp["k"], inp["v"], window=4)
    assert isinstance(o, torch.Tensor)
    o_ref, lse = flashsink.reference.attention(inp["q"], inp["k"], inp["v"], window=4, return_lse=True)
    assert torch.equal(o, o_ref)
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
    o2, lse2 = flashsink.attention(*leaves, window=4, return_lse=True)
    grads = torch.autograd.grad(o2, leaves, inp["do"])
    reports = testing.compare_all(dict(o=o2, lse=lse2, dq=grads[0], dk=grads[1], dv=grads[2]), **inp, window=4)
    assert [r.name for r in reports] == ["o", "lse", "dq", "dk", "dv"] and all(r.passed for r in reports)


@pytest.mark.l0
def test_import_is_light():
    code = "import sys, flashsink; print('tilelang' in sys.modules, flashsink.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "0.1.0"]
    assert {"attention", "attention_varlen", "reference", "testing"} <= set(flashsink.__all__)


@pytest.mark.l0
@pytest.mark.parametrize("precision", ["exact", "FAST", None, 1])
def test_precision_is_validated(precision):
    """ValueError naming the argument and the choices, on every device (also where it changes nothing)."""
    inp = testing.make_inputs(1, 2, 1, 8, 8, 16, torch.float16, "cpu", seed=3)
    with pytest.raises(ValueError, match=r"precision must be one of \('fast', 'strict'\)"):
        flashsink.attention(inp["q"], inp["k"], inp["v"], inp["sinks"], precision=precision)
    q, k, v = (inp[n][0].transpose(0, 1) for n in ("q", "k", "v"))  # [S, H, D]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="precision must be one of"):
        flashsink.attention_varlen(q, k, v, cu, cu, 8, 8, inp["sinks"], precision=precision)


@pytest.mark.l0
def test_precision_changes_nothing_off_cuda():
    """The reference is exact in its compute dtype: both modes give the same tensors, bit for bit."""
    inp = testing.make_inputs(1, 2, 1, 9, 9, 16, torch.bfloat16, "cpu", seed=4)
    out = {}
    for precision in ("fast", "strict"):
        leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks")]
        o = flashsink.attention(*leaves, window=3, precision=precision)
        out[precision] = (o, *torch.autograd.grad(o, leaves, inp["do"]))
    assert all(torch.equal(a, b) for a, b in zip(out["fast"], out["strict"]))
