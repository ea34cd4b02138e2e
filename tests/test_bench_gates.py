"""bench/gates.py: the float64 reference the gate judges by (chunked, varlen) and the gate itself,
every run of a tensor judged."""

from __future__ import annotations

import pytest
import torch

from flashsink import bench

pytestmark = pytest.mark.l1


def test_chunked_reference_matches_unchunked(monkeypatch):
    from flashsink import testing

    prob = bench.Problem("t", 2, 6, 2, 24, 24, 16, 7, "bf16")
    inp = testing.make_inputs(2, 6, 2, 24, 24, 16, torch.bfloat16, "cpu", seed=3)
    whole = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    monkeypatch.setattr(bench.gates, "_REF_SCORE_ELEMS", 2 * 24 * 24 * 2)  # two query heads per chunk
    parts = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    for n in ("o", "dq", "dk", "dv", "dsink"):
        torch.testing.assert_close(parts[n], whole[n], rtol=1e-12, atol=1e-12)


def test_varlen_reference_matches_the_varlen_api():
    from flashsink import reference

    p = bench.Problem("t", 4, 4, 2, 9, 9, 16, 3, "fp32", seqlens=(9, 1, 0, 5))
    inp = bench.make_problem_inputs(p, "cpu", seed=1)
    r = bench.reference(inp, p, sinks=True, compute_dtype=torch.float64)
    leaves = {n: inp[n].double().requires_grad_(True) for n in ("q", "k", "v", "sinks")}
    cu = inp["cu_seqlens"]
    o = reference.attention_varlen(leaves["q"], leaves["k"], leaves["v"], cu, cu, 9, 9, leaves["sinks"], window=3,
                                   compute_dtype=torch.float64)
    grads = torch.autograd.grad(o, list(leaves.values()), inp["do"].double())
    torch.testing.assert_close(r["o"], o.detach())
    for n, g in zip(("dq", "dk", "dv", "dsink"), grads):
        torch.testing.assert_close(r[n], g, msg=n)


def test_gate_judges_every_run_of_a_tensor(monkeypatch):
    """Extra results ``name@tag`` (the graph system's other graphs) are judged like ``name``: a
    wrong one fails the gate of its mode."""

    class TwoRuns(bench.Eager):
        name = "tworuns"
        bad = "o@fwd+bwd"

        def gate_outputs(self, inp, prob, grads):
            got = super().gate_outputs(inp, prob, grads)
            got["o@fwd+bwd"], got["dq@bwd"] = got["o"].clone(), got["dq"].clone()
            got[self.bad] = got[self.bad] * 1.05
            return got

    prob = bench.parse_shape("1,2,1,32,16,8", "fp32")
    inp = bench.make_problem_inputs(prob, "cpu", seed=0)
    exp = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    g = bench.gate(TwoRuns(), prob, inp, exp, None, grads=True)
    assert not g.fwd_ok and not g.bwd_ok and "o@fwd+bwd" in g.reason("fwd")
    TwoRuns.bad = "dq@bwd"
    g = bench.gate(TwoRuns(), prob, inp, exp, None, grads=True)
    assert g.fwd_ok and not g.bwd_ok and "dq@bwd" in g.reason("bwd") and not g.reason("fwd")
    assert [r.name for r in g.reports] == ["o", "dq", "dk", "dv", "dsink", "o@fwd+bwd", "dq@bwd"]
