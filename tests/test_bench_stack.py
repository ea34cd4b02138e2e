"""bench/stack.py: the gpt-oss attention stack presets (gptoss-stack-4k / -16k, issue 49's target 4):
shapes and FLOPs, the chain's wiring, gates per distinct layer, the ratio to FA4."""

from __future__ import annotations

import pytest
import torch

from flashsink import bench
from flashsink.bench import stack as bench_stack

from bench_helpers import Wrong, fake_fa4

pytestmark = pytest.mark.l1


@pytest.mark.parametrize("name,docs,length", [("gptoss-stack-4k", 8, 4096), ("gptoss-stack-16k", 2, 16384)])
def test_stack_presets_shapes_and_flops(name, docs, length):
    (p,) = bench.preset_problems(name)
    assert (p.dtype, p.heads, p.kv_heads, p.head_dim, p.window) == ("bf16", 64, 8, 64, 128)
    assert p.seqlens == (length,) * docs and p.tokens_q == 32768 and p.n == 32768 and p.kind == "stack"
    assert p.layer_windows == (128, None) * 12  # gpt-oss: sliding first, 12 of each
    layers = bench_stack.layer_problems(p)
    assert len(layers) == 24 and all(lp.layer_windows is None and lp.seqlens == p.seqlens for lp in layers)
    # 12x the full layer's + 12x the windowed layer's, the bench's convention (14 * pairs * D * H for fwd+bwd)
    full = length * (length + 1) // 2
    win = sum(min(i + 1, 128) for i in range(length))
    for mode in bench.MODES:
        assert bench.flops(p, mode) == bench.FLOP_FACTOR[mode] * 64 * 64 * docs * 12 * (full + win)
        one = [bench.Problem("x", docs, 64, 8, length, length, 64, w, "bf16", seqlens=p.seqlens) for w in (128, None)]
        assert bench.min_bytes(p, mode) == 12 * sum(bench.min_bytes(x, mode) for x in one)
    assert "stack of 24 layers (12 W=128 + 12 full)" in p.label() and f"{docs} docs of {length}" in p.label()
    (tiny,) = bench.preset_problems(name, tiny=True)
    assert tiny.kind == "stack" and tiny.layer_windows == (tiny.window, None) * 2
    with pytest.raises(ValueError, match="not a stack"):
        bench_stack.layer_problems(bench.preset_problems("golden")[0])


class _Counting(bench.System):
    """A fake layer: o = 0.5 * q + mean(v) + sinks.mean(); records each call's q and output, and counts the
    backward of each call (a custom autograd Function)."""

    name = "counting"
    peer = True
    log: list = []
    backwards: list = []

    def forward(self, t, prob):
        calls, backs = type(self).log, type(self).backwards
        idx = len(calls)

        class Layer(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, s):
                ctx.shapes = (k.shape, v.shape, s.shape)
                return 0.5 * q + v.mean() + s.mean() + 0 * k.sum()

            @staticmethod
            def backward(ctx, g):
                backs.append(idx)
                ks, vs, ss = ctx.shapes
                return 0.5 * g, torch.zeros(ks), torch.full(vs, float(g.sum()) / vs.numel()), \
                    torch.full(ss, float(g.sum()) / ss.numel())

        o = Layer.apply(t["q"], t["k"], t["v"], t["sinks"])
        calls.append((t["q"], o, prob.window, t["k"]))
        return o


def test_stack_chain_wiring_output_feeds_the_next_query_and_one_backward():
    (p,) = bench.preset_problems("gptoss-stack-4k", tiny=True)
    p = bench.Problem(p.preset, p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_kv, p.head_dim, p.window, "fp32",
                      seqlens=p.seqlens, layer_windows=(p.window, None) * 12)  # the full 24 layers, tiny tensors
    inp = bench_stack.make_stack_inputs(p, "cpu", seed=1)
    assert len(inp["layers"]) == 24
    assert not torch.equal(inp["layers"][0]["k"], inp["layers"][1]["k"])  # fixed K/V per layer, not shared
    st = bench_stack.StackSystem(_Counting(), p)
    calls = st.callables(inp, p)
    _Counting.log, _Counting.backwards = [], []
    grads = calls["fwd+bwd"]()
    log = _Counting.log
    assert len(log) == 24
    assert [w for *_, w, _k in log] == [p.window, None] * 12
    for i in range(1, 24):
        assert log[i][0] is log[i - 1][1]  # this layer's query is the previous layer's output
    for i in range(24):
        assert torch.equal(log[i][3], inp["layers"][i]["k"])  # each layer its own k
    assert sorted(_Counting.backwards) == list(range(24))  # one backward through every layer, once each
    # o = 0.5^24 q + ...: dq = 0.5^24 do; every layer's v and sinks get a gradient
    torch.testing.assert_close(grads[0], inp["do"] * 0.5 ** 24)
    assert len(grads) == 1 + 3 * 24 and all(g is not None for g in grads)


def _stack_problem_cpu():
    (p,) = bench.preset_problems("gptoss-stack-4k", tiny=True, dtype="bf16")
    return p


def test_stack_preset_runs_on_cpu_with_gates_and_ratio_vs_fa4(monkeypatch):
    """The tiny stack through run_bench: eager and a fake FA4 (the reference) gated per layer and timed, the
    wrong system gated none, sdpa unavailable with its reason, vs_fa4 from the same run, the summary line."""
    fake_fa4(monkeypatch, [])

    class Fa4CPU(bench.Fa4):
        def check_available(self, device):
            pass

    monkeypatch.setitem(bench.SYSTEMS, "fa4", Fa4CPU)
    monkeypatch.setitem(bench.SYSTEMS, "wrong", Wrong)
    p = _stack_problem_cpu()
    res = bench.run_bench([p], systems=["eager", "fa4", "wrong", "sdpa"], modes=["fwd+bwd"], device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1), gate2=True)
    rows = {r["system"]: r for r in res["rows"]}
    for name, g in (("eager", "strict"), ("fa4", "strict"), ("wrong", "none")):
        r = rows[name]
        assert r["status"] == "ok" and r["ms"] > 0 and r["gate"] == g and r["kind"] == "stack", r
        assert r["flops"] == bench.flops(p, "fwd+bwd") and r["layers"] == 4
        assert r["vs_fa4"] == pytest.approx(rows["fa4"]["ms"] / r["ms"])
    assert rows["wrong"]["gate_fails"].startswith("W=8 strict: o")
    assert rows["sdpa"]["status"].startswith("unavailable: CUDA only") and rows["sdpa"]["ms"] is None
    assert {(g["system"], g["layer"]) for g in res["gates"]} >= {("eager", "W=8"), ("eager", "full"), ("fa4", "W=8")}
    table = bench.format_table(res)
    assert "stack: gptoss-stack-4k stack of 4 layers" in table and "(target >= 1.15x)" in table


def test_stack_gate_failure_is_fail(monkeypatch):
    """A flashsink that misses its gate on the stack's full layer is FAIL (and run_bench keeps the reason)."""
    import flashsink
    from flashsink import reference

    def off_on_full(q, k, v, cu_q, cu_k, mq, mk, sinks=None, *, window=None, precision="fast", **kw):
        o = reference.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, sinks, window=window, **kw)
        return o if window is not None else o * 1.05

    monkeypatch.setattr(flashsink, "attention_varlen", off_on_full)
    res = bench.run_bench([_stack_problem_cpu()], systems=["flashsink"], modes=["fwd"], device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    (row,) = res["rows"]
    assert row["status"].startswith("FAIL (fast gate): full: o") and row["gate"] == "none", row


def test_stack_check_says_which_systems_cannot_run_it():
    p = bench.preset_problems("gptoss-stack-4k")[0]
    with pytest.raises(bench.Unavailable, match="not varlen"):
        bench_stack.check_stack(bench.Sdpa(), p, "cuda", {})
    with pytest.raises(bench.Unavailable, match="cannot capture"):
        bench_stack.check_stack(bench.SYSTEMS["flashsink-graph"](), p, "cuda", {})
    with pytest.raises(bench.Unavailable, match="shared by the stack's 24 layers"):
        bench_stack.check_stack(bench.Eager(), p, "cuda", {"eager_max_gib": 48.0})
