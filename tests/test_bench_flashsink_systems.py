"""bench/flashsink_systems.py: flashsink's own rows beyond the eager call: the paged and contiguous
KV-cache systems (NaN past the cache) and flashsink-graph (CUDA graphs, gated on a replay)."""

from __future__ import annotations

import pytest
import torch

from flashsink import bench

pytestmark = pytest.mark.l1


def _fake_kvcache(monkeypatch, calls):
    """flashsink.attention_kvcache on the reference (until the paged-KV branch lands): FlashAttention's
    flash_attn_with_kvcache semantics, the block table gathered page by page."""
    import flashsink
    from flashsink import reference

    def attention_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, sinks=None, window=None,
                          scale=None, layout="bhsd", return_lse=False):
        assert layout == "bshd", layout  # the bench's caches are [.., S, H_kv, D]
        calls.append(block_table is not None)
        outs = []
        for b, n in enumerate(cache_seqlens.tolist()):
            if block_table is None:
                k, v = k_cache[b, :n], v_cache[b, :n]
            else:
                k = k_cache[block_table[b].long()].flatten(0, 1)[:n]
                v = v_cache[block_table[b].long()].flatten(0, 1)[:n]
            outs.append(reference.attention(q[b:b + 1], k[None], v[None], sinks, window=window, scale=scale,
                                            layout="bshd"))
        return torch.cat(outs)

    monkeypatch.setattr(flashsink, "attention_kvcache", attention_kvcache, raising=False)


def test_decode_paged_preset_on_cpu(monkeypatch):
    """decode-paged: flashsink-paged (random block table, NaN past the cache) and flashsink-kvcache
    (contiguous) pass the gate next to flashsink's contiguous decode; a kernel reading past
    cache_seqlens (the NaN tail of the last page) fails it; without attention_kvcache they say why."""
    import flashsink

    probs = bench.preset_problems("decode-paged", tiny=True)
    assert [(p.seq_kv, p.page_size, p.forward_only) for p in probs] == [(64, 16, True), (200, 16, True)]
    (full, *_) = bench.preset_problems("decode-paged")
    assert (full.batch, full.page_size, full.seq_kv) == (8, 256, 4096) and "page=256" in full.label()
    monkeypatch.delattr(flashsink, "attention_kvcache", raising=False)
    with pytest.raises(bench.Unavailable, match="attention_kvcache is not in this build"):
        bench.FlashSinkPaged().check_available("cpu")
    calls = []
    _fake_kvcache(monkeypatch, calls)
    timer = bench.Timer("cpu", rep_ms=1.0, min_reps=1)
    systems = ["flashsink", "flashsink-kvcache", "flashsink-paged"]
    res = bench.run_bench(probs, systems=systems, modes=list(bench.MODES), device="cpu", timer=timer)
    for r in res["rows"]:
        if r["mode"] == "fwd":
            assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
    assert True in calls and False in calls
    t = bench.FlashSinkPaged().prepare(bench.make_problem_inputs(probs[1], "cpu", seed=0), probs[1])
    assert t["k"].shape == (2 * 13, 16, 2, 16) and t["block_table"].shape == (2, 13)  # 200 keys: 13 pages of 16
    assert sorted(t["block_table"].flatten().tolist()) == list(range(26))
    assert t["block_table"].flatten().tolist() != list(range(26))  # pages out of order
    assert torch.isnan(t["k"][t["block_table"][0, -1].long(), 200 - 12 * 16:]).all()  # the poisoned tail

    right = flashsink.attention_kvcache

    def reads_past_the_end(q, k_cache, v_cache, cache_seqlens, **kw):
        return right(q, k_cache, v_cache, cache_seqlens + 1, **kw)

    monkeypatch.setattr(flashsink, "attention_kvcache", reads_past_the_end)
    res = bench.run_bench(probs[1:], systems=["flashsink-paged"], modes=["fwd"], device="cpu", timer=timer)
    assert res["rows"][0]["status"].startswith("FAIL") and res["rows"][0]["gate"] == "none", res["rows"][0]
    with pytest.raises(bench.Unavailable, match="decode"):
        bench.FlashSinkKVCache().check_problem(bench.preset_problems("golden", tiny=True)[0], "cpu", {})
    with pytest.raises(bench.Unavailable, match="page size"):
        bench.FlashSinkPaged().check_problem(bench.preset_problems("decode", tiny=True)[0], "cpu", {})


def test_graph_system_is_registered_next_to_flashsink():
    names = list(bench.SYSTEMS)
    assert names[names.index("flashsink") + 1] == "flashsink-graph"
    g = bench.SYSTEMS["flashsink-graph"]()
    assert isinstance(g, bench.FlashSink) and g.has_sink and not g.peer
    with pytest.raises(bench.Unavailable, match="CUDA only"):
        g.check_available("cpu")
    g.check_available("cuda")  # nothing else to ask: the gate proves a replay on the GPU
    varlen, _ = bench.preset_problems("varlen", tiny=True)
    with pytest.raises(bench.Unavailable, match="cannot capture"):
        g.check_problem(varlen, "cuda", {})
    g.check_problem(bench.preset_problems("decode", tiny=True)[0], "cuda", {})
    g.check_problem(bench.preset_problems("golden", tiny=True)[0], "cuda", {})


def test_graph_system_listed_unavailable_on_cpu():
    prob = bench.parse_shape("1,2,1,32,16,8", "fp32")
    res = bench.run_bench([prob], systems=["flashsink", "flashsink-graph"], modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    rows = {(r["system"], r["mode"]): r for r in res["rows"]}
    for mode in bench.MODES:
        assert rows[("flashsink", mode)]["status"] == "ok"
        r = rows[("flashsink-graph", mode)]
        assert r["status"] == "unavailable: CUDA only (CUDA graphs)" and r["ms"] is None
    assert [g["system"] for g in res["gates"]] == ["flashsink"]  # never gated, never timed
    table = bench.format_table(res)
    assert "flashsink-graph" in table and "unavailable: CUDA only (CUDA graphs)" in table
    assert "graph ms" in table


def _fake_cuda_graphs(monkeypatch):
    """torch.cuda's stream and graph API as no-ops: a "capture" runs its body once, a "replay" does
    nothing."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        replays = 0

        def replay(self):
            type(self).replays += 1

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return Graph


def test_graph_gate_checks_a_replay_not_the_capture(monkeypatch):
    """The capture computes the right result once; the gate fills every static output with NaN and
    judges what a replay leaves there. A replay that computes nothing fails."""
    Graph = _fake_cuda_graphs(monkeypatch)
    prob = bench.parse_shape("1,2,1,32,16,8", "fp32")
    inp = bench.make_problem_inputs(prob, "cpu", seed=0)
    exp = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    system = bench.FlashSinkGraph()
    g = bench.gate(system, prob, inp, exp, None, grads=True)
    assert Graph.replays == 3  # fwd, fwd+bwd, bwd
    names = [r.name for r in g.reports]
    assert names == ["o", "dq", "dk", "dv", "dsink", "o@fwd+bwd", "dq@bwd", "dk@bwd", "dv@bwd", "dsink@bwd"]
    assert not any(r.passed for r in g.reports) and not g.fwd_ok and not g.bwd_ok
    # the timing replays the gated graphs
    calls = system.callables(inp, prob)
    assert set(calls) == set(bench.MODES)
    calls["fwd"]()
    assert Graph.replays == 4
    system.release()
    assert system._graphs == {}
