"""bench/run.py: the loop over problems and systems: every system gated then timed, its row saying the
strongest gate it passes; flashsink held to its own mode's gate; a crash is FAIL, never timed."""

from __future__ import annotations

import pytest

from flashsink import bench

from bench_helpers import Wrong, tiny_new_presets

pytestmark = pytest.mark.l1


class _Lowp(bench.Eager):
    """The reference computed in the input dtype (what plain PyTorch gives): fails the strict gate on a
    bf16 problem, passes the fast one."""

    name = "lowp"
    note = "reference in the input dtype"

    def forward(self, t, prob):
        from flashsink import reference

        return reference.attention(t["q"], t["k"], t["v"], t["sinks"], window=prob.window, causal=prob.causal,
                                   scale=prob.scale, compute_dtype=t["q"].dtype)


def test_gate_marks_every_system_with_the_gate_it_passes_and_times_it(monkeypatch):
    """Peers are timed whatever gate they pass, and the row says which: strict, fast or none."""
    monkeypatch.setitem(bench.SYSTEMS, "wrong", Wrong)
    monkeypatch.setitem(bench.SYSTEMS, "lowp", _Lowp)
    timed = []

    class CountingTimer(bench.Timer):
        def __call__(self, fn):
            timed.append(fn)
            return super().__call__(fn)

    prob = bench.parse_shape("1,4,2,64,32,16", "bf16")
    timer = CountingTimer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench([prob], systems=["eager", "lowp", "wrong"], modes=list(bench.MODES), device="cpu",
                          timer=timer)
    rows = {(r["system"], r["mode"]): r for r in res["rows"]}
    for mode in bench.MODES:
        for name, gate in (("eager", "strict"), ("lowp", "fast"), ("wrong", "none")):
            r = rows[(name, mode)]
            assert r["status"] == "ok" and r["ms"] > 0 and r["gate"] == gate, r
        assert rows[("lowp", mode)]["gate_fails"].startswith("strict: o")
        assert rows[("wrong", mode)]["gate_fails"].startswith("strict: o") and "fast: o" in \
            rows[("wrong", mode)]["gate_fails"]
        assert rows[("eager", mode)]["gate_fails"] == ""
        assert (rows[("eager", mode)]["host_us"] is None) == (mode == "bwd")
    assert len(timed) == 2 + 3 * 3  # two ceilings, three modes of three systems
    gates = {g["system"]: g for g in res["gates"]}
    assert not all(r["passed"] for r in gates["wrong"]["reports"])
    assert all(r["passed"] for r in gates["lowp"]["fast_reports"]) and {r["gate"] for r in
                                                                        gates["lowp"]["fast_reports"]} == {"fast"}
    table = bench.format_table(res)
    assert "(fails strict: o" in table and "host us" in table


def test_flashsink_must_pass_its_own_precision_gate(monkeypatch, tmp_path):
    """flashsink (fast) judged by the fast gate, flashsink-strict by the standard: a flashsink that
    misses its gate is FAIL (timed all the same)."""
    import flashsink
    from flashsink import reference

    seen = []

    def lowp_attention(q, k, v, sinks=None, *, precision="fast", **kw):
        seen.append(precision)
        return reference.attention(q, k, v, sinks, compute_dtype=q.dtype, **kw)

    monkeypatch.setattr(flashsink, "attention", lowp_attention)
    prob = bench.parse_shape("1,4,2,64,32,16", "bf16")
    res = bench.run_bench([prob], systems=["flashsink", "flashsink-strict"], modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    rows = {(r["system"], r["mode"]): r for r in res["rows"]}
    assert {"fast", "strict"} <= set(seen)
    for mode in bench.MODES:
        assert rows[("flashsink", mode)]["status"] == "ok" and rows[("flashsink", mode)]["gate"] == "fast"
        bad = rows[("flashsink-strict", mode)]
        assert bad["status"].startswith("FAIL (strict gate): o: only") and bad["ms"] > 0 and bad["gate"] == "fast"
    assert "FAIL (strict gate)" in bench.format_table(res)


def test_gate_reports_a_crash_as_fail(monkeypatch):
    class Crash(bench.Eager):
        name = "crash"

        def forward(self, t, prob):
            raise RuntimeError("boom")

    monkeypatch.setitem(bench.SYSTEMS, "crash", Crash)
    prob = bench.parse_shape("1,2,1,32,16", "fp32")
    res = bench.run_bench([prob], systems=["crash"], modes=["fwd"], device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    (row,) = res["rows"]
    assert row["status"].startswith("FAIL") and "boom" in row["status"] and row["ms"] is None


def test_varlen_and_decode_run_on_cpu_with_the_gate(monkeypatch):
    monkeypatch.setitem(bench.SYSTEMS, "wrong", Wrong)
    Wrong.calls = 0
    probs = tiny_new_presets()
    res = bench.run_bench(probs, systems=list(bench.SYSTEMS), modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    rows = res["rows"]
    assert len(rows) == len(probs) * len(bench.SYSTEMS) * len(bench.MODES)  # no system, no mode dropped
    assert Wrong.calls > len(probs)  # one gate call per problem, then timed
    for r in rows:
        p = next(x for x in probs if x.label() == r["problem"])
        assert r["kind"] == p.kind and r["N"] == p.n and r["window"] == p.window
        assert r["flops"] == bench.flops(p, r["mode"]) and r["bytes"] == bench.min_bytes(p, r["mode"])
        if p.forward_only and r["mode"] != "fwd":
            assert r["status"] == bench.FORWARD_ONLY and r["ms"] is None
        elif r["system"] in ("flashsink", "flashsink-strict", "flashsink-det", "eager", "wrong"):
            assert r["status"] == "ok", r
            assert r["ms"] > 0 and r["tflops"] > 0 and r["gbs"] > 0 and r["pct_floor"] > 0
            assert r["gate"] == ("none" if r["system"] == "wrong" else "strict"), r
        elif r["system"] in ("flashsink-kvcache", "flashsink-paged"):  # decode only, once attention_kvcache exists
            assert r["status"].startswith(("unavailable: ", "n/a: ")) or (p.forward_only and r["status"] == "ok"), r
        else:  # CUDA-only peers: listed with a reason
            assert r["status"].startswith("unavailable: "), r
    gated = {(g["problem"]["preset"], g["problem"]["window"], g["problem"]["seq_kv"], g["system"])
             for g in res["gates"]
             if g["system"] in ("flashsink", "flashsink-strict", "flashsink-det", "eager", "wrong")}
    assert len(gated) == len(probs) * 5  # flashsink, flashsink-strict, flashsink-det, eager, wrong
    for g in res["gates"]:
        assert g["problem"]["forward_only"] == (g["problem"]["preset"] == "decode")
        names = [x["name"] for x in g["reports"]]
        assert names == (["o"] if g["problem"]["forward_only"] else ["o", "dq", "dk", "dv", "dsink"])
    table = bench.format_table(res)
    assert "forward only" in table and "len " in table and "(fails strict: o" in table
