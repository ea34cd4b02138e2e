"""`flashsink bench` on the CPU: pair counting, FLOP / byte formulas, the correctness gate (a
wrong system is FAIL and never timed), the CPU smoke run and the no-CUDA exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashsink import bench
from flashsink.reference import visible_mask

pytestmark = pytest.mark.l1

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "sq,skv,window,causal",
    [
        (64, 64, None, True), (64, 64, 16, True), (64, 64, 1, True), (64, 64, 200, True),
        (17, 64, None, True), (17, 64, 8, True), (64, 17, None, True), (64, 17, 5, True),
        (33, 50, None, False), (1, 100, 7, True), (100, 1, None, True),
    ],
)
def test_visible_pairs_match_mask(sq, skv, window, causal):
    expected = int(visible_mask(sq, skv, window=window, causal=causal).sum())
    assert bench.visible_pairs(sq, skv, window, causal) == expected


def test_flops_and_bytes():
    p = bench.Problem("t", 2, 8, 2, 128, 128, 64, None, "bf16")
    pairs = 2 * 8 * (128 * 129 // 2)
    assert bench.flops(p, "fwd") == 4 * pairs * 64
    assert bench.flops(p, "bwd") == 10 * pairs * 64
    assert bench.flops(p, "fwd+bwd") == 14 * pairs * 64
    q = 2 * 8 * 128 * 64 * 2
    kv = 2 * 2 * 128 * 64 * 2
    assert bench.min_bytes(p, "fwd") == 2 * q + 2 * kv  # q, k, v in; o out
    assert bench.min_bytes(p, "bwd") == 3 * q + 4 * kv  # q, k, v, do in; dq, dk, dv out
    assert bench.min_bytes(p, "fwd+bwd") == 4 * q + 4 * kv
    # golden: the windowed preset is bound by bytes, not FLOPs, at the ceilings
    g = bench.preset_problems("golden")[0]
    t_flops = bench.flops(g, "fwd") / 709e12
    t_bytes = bench.min_bytes(g, "fwd") / 4.22e12
    assert t_bytes > t_flops
    assert abs(t_bytes * 1e3 - 0.036) < 0.002  # the floor for golden fwd


def test_presets_and_shape():
    assert set(bench.PRESETS) == {"golden", "gptoss-swa", "gptoss-full", "causal-d128", "varlen", "decode", "hf-train",
                                  "decode-paged", "gptoss-stack-4k", "gptoss-stack-16k"}
    assert set(bench.TINY_PRESETS) == set(bench.PRESETS)
    g = bench.preset_problems("golden")[0]
    assert (g.dtype, g.batch, g.heads, g.kv_heads, g.seq_q, g.head_dim, g.window) == ("fp16", 1, 64, 8, 4096, 128, 128)
    assert [p.seq_q for p in bench.preset_problems("gptoss-full")] == [2048, 4096, 8192, 16384]
    p = bench.parse_shape("1,4,2,64:96,32,16", "bf16")
    assert (p.seq_q, p.seq_kv, p.window, p.dtype) == (64, 96, 16, "bf16")
    assert bench.parse_shape("1,4,2,64,32", "fp16").window is None
    with pytest.raises(ValueError):
        bench.parse_shape("1,4,2", "fp16")


class _Wrong(bench.Eager):
    """The reference with its output scaled by 1.05: passes no gate, is timed and says so."""

    name = "wrong"
    note = "deliberately wrong"
    calls = 0

    def forward(self, t, prob):
        type(self).calls += 1
        return super().forward(t, prob) * 1.05


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
    monkeypatch.setitem(bench.SYSTEMS, "wrong", _Wrong)
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


def test_sdpa_gradients_fold_expanded_heads():
    prob = bench.Problem("t", 1, 4, 2, 8, 8, 16, 4, "fp32")
    x = torch.arange(1 * 4 * 8 * 16, dtype=torch.float32).view(1, 4, 8, 16)
    folded = bench.Sdpa().to_bhsd("dk", x, prob)
    assert torch.equal(folded, x[:, 0::2] + x[:, 1::2])


def _run(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "flashsink", "bench", *args], capture_output=True, text=True,
                          cwd=ROOT, env=e, timeout=300)


def test_cpu_smoke_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = _run("--device", "cpu", "--shape", "1,4,2,64,32,16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(x["system"], x["mode"]) for x in rows if x["status"] == "ok"} >= {
        ("flashsink", m) for m in bench.MODES
    } | {("eager", m) for m in bench.MODES}
    for x in rows:
        if x["status"] == "ok":
            assert x["ms"] > 0 and x["tflops"] > 0 and x["gbs"] > 0 and x["pct_floor"] > 0
        else:  # CUDA-only systems (and the decode-only kvcache rows) are listed with a reason, not dropped
            assert x["status"].startswith(("unavailable", "n/a")), x
    assert {x["system"] for x in rows} == set(bench.SYSTEMS)
    assert data["ceilings"]["matmul_tflops"] > 0 and data["ceilings"]["copy_gbs"] > 0
    assert data["header"]["commit"]
    assert "flashsink" in r.stdout and "TFLOP/s" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_no_cuda_exits_with_message():
    r = _run()
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "--device cpu" in r.stderr


def test_chunked_reference_matches_unchunked(monkeypatch):
    from flashsink import testing

    prob = bench.Problem("t", 2, 6, 2, 24, 24, 16, 7, "bf16")
    inp = testing.make_inputs(2, 6, 2, 24, 24, 16, torch.bfloat16, "cpu", seed=3)
    whole = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    monkeypatch.setattr(bench.gates, "_REF_SCORE_ELEMS", 2 * 24 * 24 * 2)  # two query heads per chunk
    parts = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    for n in ("o", "dq", "dk", "dv", "dsink"):
        torch.testing.assert_close(parts[n], whole[n], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# varlen and decode presets


def _brute_pairs_varlen(seqlens, window, causal):
    """Visible pairs over the packed [T, T] grid: same sequence, causal / window on the packed positions."""
    doc = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens, dtype=torch.long))
    i = torch.arange(len(doc)).unsqueeze(1)
    j = torch.arange(len(doc)).unsqueeze(0)
    keep = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= i - j < window
    return int(keep.sum())


def _brute_bytes(inp, o_shape, mode):
    """Bytes of the tensors each mode must read and write, summed from the real tensors."""
    def nb(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    o = torch.empty(o_shape, dtype=q.dtype)
    fwd = nb(q, k, v) + nb(o)
    bwd = nb(q, k, v, do) + nb(q, k, v)  # dq, dk, dv are shaped like q, k, v
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": bwd + nb(o)}[mode]


@pytest.mark.parametrize("window,causal", [(None, True), (1, True), (4, True), (13, True), (1000, True),
                                           (None, False)])
def test_varlen_flops_and_bytes_brute_force(window, causal):
    lens = (0, 1, 7, 20, 3, 0, 33)  # empty sequences and a single token on purpose
    p = bench.Problem("t", len(lens), 6, 2, max(lens), max(lens), 16, window, "bf16", causal, seqlens=lens)
    pairs = _brute_pairs_varlen(lens, window, causal)
    assert bench.problem_pairs(p) == pairs
    inp = bench.make_problem_inputs(p, "cpu", seed=0)
    assert inp["q"].shape == (sum(lens), 6, 16) and inp["k"].shape == (sum(lens), 2, 16)
    assert inp["cu_seqlens"].tolist() == [0, 0, 1, 8, 28, 31, 31, 64] and inp["max_seqlen"] == 33
    for mode in bench.MODES:
        assert bench.flops(p, mode) == bench.FLOP_FACTOR[mode] * 6 * pairs * 16
        assert bench.min_bytes(p, mode) == _brute_bytes(inp, inp["q"].shape, mode)


@pytest.mark.parametrize("seq_kv,window", [(37, None), (37, 5), (1, None), (300, 299)])
def test_decode_flops_and_bytes_brute_force(seq_kv, window):
    p = bench.Problem("t", 3, 4, 2, 1, seq_kv, 16, window, "bf16", forward_only=True)
    pairs = 3 * int(visible_mask(1, seq_kv, window=window, causal=True).sum())
    assert bench.problem_pairs(p) == pairs
    assert pairs == 3 * (seq_kv if window is None else min(window, seq_kv))  # the last row sees the cache tail
    inp = bench.make_problem_inputs(p, "cpu", seed=0)
    assert bench.flops(p, "fwd") == 4 * 4 * pairs * 16
    assert bench.min_bytes(p, "fwd") == _brute_bytes(inp, inp["q"].shape, "fwd")
    assert p.n == seq_kv and p.kind == "decode"


def test_varlen_and_decode_presets():
    a, b = bench.preset_problems("varlen")
    assert (a.window, b.window) == (128, None) and a.causal and b.causal
    assert a.seqlens == b.seqlens and len(a.seqlens) == 64 and sum(a.seqlens) == 32768 and min(a.seqlens) >= 1
    assert (a.dtype, a.heads, a.kv_heads, a.head_dim, a.batch) == ("bf16", 64, 8, 64, 64)
    assert a.seq_q == a.seq_kv == max(a.seqlens) and a.n == 32768
    assert bench.preset_problems("varlen")[0].seqlens == a.seqlens  # a fixed seed: every run packs the same batch
    assert bench.lengths_summary(a.seqlens) == "10/384/2590"  # pinned: docs/bench.md quotes it, runs stay comparable
    assert bench.lengths_summary(a.seqlens) in a.label()
    dec = bench.preset_problems("decode")
    assert [p.seq_kv for p in dec] == [4096, 16384, 65536]
    assert all(p.seq_q == 1 and p.batch == 8 and p.forward_only and p.causal and p.dtype == "bf16" for p in dec)
    # decode moves the whole cache for a few FLOPs: bound by bytes at the ceilings
    for p in dec:
        assert bench.min_bytes(p, "fwd") / 4.22e12 > 20 * bench.flops(p, "fwd") / 709e12
    for name in bench.PRESETS:  # every preset has a CPU version of the same kind
        big, small = bench.preset_problems(name), bench.preset_problems(name, tiny=True)
        assert {p.kind for p in big} == {p.kind for p in small} and len(small) >= 1
    lens = bench.varlen_lengths(5, 12, seed=1)
    assert len(lens) == 5 and sum(lens) == 12 and min(lens) >= 1
    with pytest.raises(ValueError):
        bench.varlen_lengths(13, 12)


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


def _tiny_new_presets():
    return bench.preset_problems("varlen", tiny=True, dtype="fp32") + bench.preset_problems("decode", tiny=True,
                                                                                            dtype="fp32")


def test_varlen_and_decode_run_on_cpu_with_the_gate(monkeypatch):
    monkeypatch.setitem(bench.SYSTEMS, "wrong", _Wrong)
    _Wrong.calls = 0
    probs = _tiny_new_presets()
    res = bench.run_bench(probs, systems=list(bench.SYSTEMS), modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    rows = res["rows"]
    assert len(rows) == len(probs) * len(bench.SYSTEMS) * len(bench.MODES)  # no system, no mode dropped
    assert _Wrong.calls > len(probs)  # one gate call per problem, then timed
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


def test_systems_that_cannot_run_say_why():
    varlen, _ = bench.preset_problems("varlen", tiny=True)
    dec = bench.preset_problems("decode", tiny=True)[0]
    with pytest.raises(bench.Unavailable, match="not varlen"):
        bench.Sdpa().check_problem(varlen, "cuda", {})
    bench.Sdpa().check_problem(dec, "cuda", {})  # sdpa runs decode (no mask needed: one row sees all)
    assert not bench.Sdpa()._dense(dec) and "no mask" in bench.Sdpa().problem_note(dec)
    with pytest.raises(bench.Unavailable, match="forward only"):
        bench.Fla().check_problem(dec, "cuda", {"grads": True})


def _fake_fla(monkeypatch):
    """An `fla` with parallel_attn / attn_decoding_one_step built on the reference, so the bench's
    FLA plumbing (layouts, cu_seqlens, decode packing) is checked on the CPU."""
    import types

    from flashsink import reference

    def parallel_attn(q, k, v, g=None, scale=None, window_size=None, cu_seqlens=None, chunk_indices=None, *,
                      sink_bias=None):
        if cu_seqlens is None:
            return reference.attention(q, k, v, sink_bias, window=window_size, scale=scale, layout="bshd")
        assert q.shape[0] == 1
        m = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return reference.attention_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, m, m, sink_bias,
                                          window=window_size, scale=scale)[None]

    def attn_decoding_one_step(q, k, v, g=None, scale=None, cu_seqlens=None, do_gate_scale=False, *,
                               sink_bias=None):
        cu = cu_seqlens.tolist()
        outs = [reference.attention(q[:, i:i + 1], k[:, cu[i]:cu[i + 1]], v[:, cu[i]:cu[i + 1]], sink_bias,
                                    scale=scale, layout="bshd") for i in range(len(cu) - 1)]
        return torch.cat(outs, 1)

    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.attn", "fla.ops.attn.parallel",
                                             "fla.ops.attn.decoding")}
    mods["fla.ops.attn.parallel"].parallel_attn = parallel_attn
    mods["fla.ops.attn.decoding"].attn_decoding_one_step = attn_decoding_one_step
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def test_fla_and_flex_plumbing_on_cpu(monkeypatch):
    """FLA (a fake one on the reference) and FlexAttention (eager, forward: flex has no CPU
    backward) pass the gate on the varlen and decode problems: their layouts round-trip."""
    _fake_fla(monkeypatch)

    class FlaCPU(bench.Fla):
        def check_available(self, device):
            pass

    class FlexCPU(bench.Flex):
        def __init__(self):
            super().__init__(compile=False)

        def check_available(self, device):
            pass

        def forward(self, t, prob):  # flex refuses CPU inputs that require grad, even under no_grad
            return super().forward({k: v.detach() if torch.is_tensor(v) else v for k, v in t.items()}, prob)

    monkeypatch.setitem(bench.SYSTEMS, "fla", FlaCPU)
    monkeypatch.setitem(bench.SYSTEMS, "flex", FlexCPU)
    probs = _tiny_new_presets()
    timer = bench.Timer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench(probs, systems=["fla", "flex"], modes=["fwd"], device="cpu", timer=timer, gate2=False)
    for r in res["rows"]:
        assert r["status"] == "ok", r
    # FLA with gradients on varlen (the fake is differentiable); decode is forward only
    res = bench.run_bench(probs[:1], systems=["fla"], modes=list(bench.MODES), device="cpu", timer=timer,
                          gate2=False)
    assert all(r["status"] == "ok" for r in res["rows"]), res["rows"]


def _fake_fa4(monkeypatch, calls):
    """A `flash_attn.cute.interface` built on the reference, FA4's signatures and conventions: [B, S, H, D],
    window_size=(W - 1, 0), learnable_sink, (o, lse) returned; varlen on packed [total, H, D]."""
    import types

    from flashsink import reference

    def window(window_size, causal):
        left, right = window_size
        assert causal and right in (0, None)
        return None if left is None else left + 1

    def flash_attn_func(q, k, v, qv=None, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, return_lse=False, **kw):
        calls.append(("dense", q.shape))
        return reference.attention(q, k, v, learnable_sink, window=window(window_size, causal), scale=softmax_scale,
                                   causal=causal, layout="bshd", return_lse=True)

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                               learnable_sink=None, **kw):
        calls.append(("varlen", q.shape))
        assert cu_seqlens_q.dtype == torch.int32 and q.dim() == 3
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          learnable_sink, window=window(window_size, causal), scale=softmax_scale,
                                          causal=causal, return_lse=True)

    mods = {n: types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")}
    mods["flash_attn.cute.interface"].flash_attn_func = flash_attn_func
    mods["flash_attn.cute.interface"].flash_attn_varlen_func = flash_attn_varlen_func
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def test_fa4_plumbing_on_cpu(monkeypatch):
    """FA4 (a fake one on the reference): its layout, window and sink conventions round-trip through the
    gate on dense, varlen and decode problems, forward and backward."""
    calls = []
    _fake_fa4(monkeypatch, calls)

    class Fa4CPU(bench.Fa4):
        def check_available(self, device):
            pass

    monkeypatch.setitem(bench.SYSTEMS, "fa4", Fa4CPU)
    probs = [bench.preset_problems("gptoss-swa", tiny=True)[0], *bench.preset_problems("varlen", tiny=True),
             bench.preset_problems("decode", tiny=True)[0]]
    res = bench.run_bench(probs, systems=["fa4"], modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    for r in res["rows"]:
        if r["status"] != bench.FORWARD_ONLY:
            assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
    assert {c[0] for c in calls} == {"dense", "varlen"}
    assert ("dense", (1, 128, 4, 16)) in calls  # [B, S, H, D]
    with pytest.raises(bench.Unavailable, match="fp16 / bf16"):
        bench.Fa4().check_problem(bench.parse_shape("1,2,1,32,16", "fp32"), "cuda", {})
    with pytest.raises(bench.Unavailable, match="CUDA only"):
        bench.Fa4().check_available("cpu")


def test_fa4_listed_unavailable_without_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface", raising=False)
    with pytest.raises(bench.Unavailable, match="import flash_attn.cute.interface"):
        bench.Fa4().check_available("cuda")


def test_hf_train_preset_on_cpu(monkeypatch):
    """The GptOss training step: flashsink and eager gated (logits) and timed with tokens/s, flex listed
    unavailable off CUDA, and an implementation that runs out of memory reported skipped with the reason."""
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    from flashsink.bench import hf as bench_hf

    (prob,) = bench.preset_problems("hf-train", tiny=True, dtype="fp32")
    assert prob.kind == "hf-train" and "GptOssForCausalLM" in prob.label()
    (full,) = bench.preset_problems("hf-train")
    assert (full.heads, full.kv_heads, full.head_dim, full.window, full.seq_q, full.dtype) == (64, 8, 64, 128, 16384,
                                                                                               "bf16")
    real = bench_hf._with_impl

    def eager_oom_when_long(model, impl, dtype):
        m = real(model, impl, dtype)
        forward = m.forward

        def fwd(*args, input_ids=None, **kw):
            if impl == "eager" and input_ids.shape[1] > bench_hf.TINY_GATE_TOKENS:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
            return forward(*args, input_ids=input_ids, **kw)

        m.forward = fwd
        return m

    timer = bench.Timer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench([prob], systems=["flashsink", "flex", "eager"], modes=list(bench.MODES), device="cpu",
                          timer=timer)
    rows = {r["system"]: r for r in res["rows"]}
    assert set(rows) == {"hf/flashsink", "hf/flex_attention", "hf/eager"}
    for name in ("hf/flashsink", "hf/eager"):
        r = rows[name]
        assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
        assert r["tokens_s"] == pytest.approx(prob.seq_q / (r["ms"] * 1e-3))
    assert rows["hf/flex_attention"]["status"].startswith("unavailable: CUDA only")
    assert {g["system"] for g in res["gates"]} == {"hf/flashsink", "hf/eager"}
    assert "tokens/s" in bench.format_table(res)

    monkeypatch.setattr(bench_hf, "_with_impl", eager_oom_when_long)
    res = bench.run_bench([prob], systems=["flashsink", "eager"], modes=["fwd+bwd"], device="cpu", timer=timer)
    rows = {r["system"]: r for r in res["rows"]}
    assert rows["hf/eager"]["status"].startswith("skipped: out of memory at 96 tokens") and rows["hf/eager"]["ms"] is None
    assert rows["hf/flashsink"]["status"] == "ok"
    res = bench.run_bench([prob], systems=["flashsink"], modes=["fwd"], device="cpu", timer=timer)
    assert res["rows"][0]["status"].startswith("n/a: the training step is fwd+bwd")


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


def test_cpu_cli_runs_the_new_presets(tmp_path):
    out = tmp_path / "bench.json"
    r = _run("--device", "cpu", "--preset", "varlen,decode", "--systems", "flashsink,sdpa", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {x["preset"] for x in data["rows"]} == {"varlen", "decode"}
    assert "lengths min/median/max" in r.stderr
    ok = {(x["kind"], x["mode"]) for x in data["rows"] if x["status"] == "ok"}
    assert ok == {("varlen", m) for m in bench.MODES} | {("decode", "fwd")}


def test_preset_all_lists_every_preset(tmp_path):
    """`--preset all` covers varlen and decode too; sdpa (CUDA only) is listed on every row with its reason."""
    out = tmp_path / "bench.json"
    r = _run("--device", "cpu", "--preset", "all", "--systems", "sdpa", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {x["preset"] for x in rows} == set(bench.PRESETS)
    for x in rows:
        if x["kind"] == "hf-train":  # a model step: sdpa is not one of its attn_implementations
            assert x["status"].startswith("n/a: the training step compares attn_implementation"), x
            continue
        assert x["status"] == bench.FORWARD_ONLY if (x["kind"] == "decode" and x["mode"] != "fwd") else \
            x["status"].startswith("unavailable: CUDA only"), x


# ----------------------------------------------------------------------------------------------
# flashsink-graph: flashsink replayed from CUDA graphs


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


def test_cli_accepts_the_graph_system(tmp_path):
    out = tmp_path / "bench.json"
    r = _run("--device", "cpu", "--shape", "1,2,1,32,16", "--systems", "flashsink-graph,flashsink", "--mode", "fwd",
             "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(x["system"], x["status"]) for x in rows] == [
        ("flashsink-graph", "unavailable: CUDA only (CUDA graphs)"), ("flashsink", "ok")]
    r = _run("--device", "cpu", "--systems", "flashsink-grap")
    assert r.returncode == 2 and "flashsink-graph" in r.stderr  # the error lists the known systems


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


@pytest.mark.l0
def test_plot_title_of_one_run_and_of_a_merged_result():
    """`--plot` titles a single run by its header, and tools/bench_merge.py's merged result (no
    top-level header: one per run) by every run's device, commit and date range."""
    h1 = {"device": "NVIDIA H200", "commit": "a" * 40, "date": "2026-12-03 03:21 UTC"}
    h2 = dict(h1, commit="b" * 40, date="2026-12-03 03:40 UTC")
    assert bench.plot_title({"header": h1, "rows": []}) == \
        "flashsink bench - NVIDIA H200 - aaaaaaaaaaaa - 2026-12-03 03:21 UTC"
    merged = {"runs": [{"header": h1}, {"header": h2}], "rows": []}
    assert bench.plot_title(merged) == ("flashsink bench - NVIDIA H200 - aaaaaaaaaaaa, bbbbbbbbbbbb - "
                                        "2026-12-03 03:21 UTC .. 2026-12-03 03:40 UTC")


def _bench_cli(*argv):
    from flashsink.cli import main

    return main(["bench", "--device", "cpu", *argv])


class _Planned(Exception):
    pass


def _planned(monkeypatch, *argv):
    """The problems a bench command would run (its run stopped before any work)."""
    def fake_run(problems, **kw):
        raise _Planned(problems)

    monkeypatch.setattr(bench.command, "run_bench", fake_run)
    with pytest.raises(_Planned) as exc:
        _bench_cli(*argv)
    return exc.value.args[0]


@pytest.mark.boundary
@pytest.mark.parametrize("argv, needle", [
    (["--shape", "1,4,2,16,16,0"], "window W must be >= 1"),
    (["--shape", "1,4,2,16,16,-3"], "window W must be >= 1"),
    (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json"),
    (["--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png"),
    (["--preset", "golden", "--seq", "4096"], "--seq 4096 matches no problem of golden"),
    (["--preset", "golden", "--seq", "0"], "--seq: lengths must be >= 1"),
    (["--preset", "golden", "--seq", "x"], "--seq wants comma-separated lengths"),
    (["--shape", "1,4,2,16,16", "--seq", "16"], "--seq selects lengths of the presets"),
])
def test_bench_usage_errors_exit_2_before_running(monkeypatch, argv, needle, capsys):
    def never(*a, **kw):
        raise AssertionError("the run started")

    monkeypatch.setattr(bench.command, "run_bench", never)
    assert _bench_cli(*argv) == 2
    assert needle in capsys.readouterr().err


def test_bench_seed_beyond_64_bits_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_cli("--seed", str(2 ** 64))
    assert exc.value.code == 2 and "--seed" in capsys.readouterr().err


def test_bench_dtype_default_is_what_the_help_says(monkeypatch):
    from flashsink.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "fp32 on cpu" in help_text
    assert [p.dtype for p in _planned(monkeypatch, "--shape", "1,4,2,16,16")] == ["fp32"]  # was bf16
    assert [p.dtype for p in _planned(monkeypatch, "--shape", "1,4,2,16,16", "--dtype", "bf16")] == ["bf16"]
    assert {p.dtype for p in _planned(monkeypatch, "--preset", "golden")} == {"fp32"}
    assert {p.dtype for p in _planned(monkeypatch, "--preset", "golden", "--dtype", "fp16")} == {"fp16"}


def test_precompile_covers_every_flashsink_row(monkeypatch):
    """``flashsink bench`` on CUDA builds, in parallel before timing, the kernels of each flashsink row it
    times: fast, strict and deterministic configurations of every padded problem (not the varlen ones,
    which compile at their gate)."""
    from flashsink.bench import command
    from flashsink.ops.launch import dense
    from flashsink.ops.build import precompile as precompile_mod

    got = []
    monkeypatch.setattr(dense, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(dense, "_CONFIGS", {})
    monkeypatch.setattr(precompile_mod, "precompile", lambda cfgs: got.extend(cfgs))
    prob = bench.parse_shape("1,4,2,64,32,16", "bf16")
    varlen, _ = bench.preset_problems("varlen", tiny=True)
    rows = ((False, "fast"), (True, "fast"), (False, "strict"))
    command._precompile([prob, varlen], "cuda", rows)
    assert [(c.deterministic, c.precision) for c in got] == list(rows)
    assert {(c.arch, c.head_dim, c.groups, c.layout) for c in got} == {("sm_90a", 32, 2, "bhsd")}


# ----------------------------------------------------------------------------------------------
# the attention stack (gptoss-stack-4k / -16k) and --host-chain (issue 49, targets 4 and 5)

from flashsink.bench import host_chain as hc  # noqa: E402
from flashsink.bench import stack as bench_stack  # noqa: E402


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
    _fake_fa4(monkeypatch, [])

    class Fa4CPU(bench.Fa4):
        def check_available(self, device):
            pass

    monkeypatch.setitem(bench.SYSTEMS, "fa4", Fa4CPU)
    monkeypatch.setitem(bench.SYSTEMS, "wrong", _Wrong)
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


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _FakeBusy:
    """The GPU as a clock: hold(ms) busy until now + ms; finished: the clock is past the end."""

    def __init__(self, clock):
        self.clock, self.holds, self.syncs = clock, [], 0

    def hold(self, ms):
        self.holds.append(ms)
        return self.clock.t + ms * 1e-3

    def finished(self, end):
        return self.clock.t >= end

    def sync(self):
        self.syncs += 1


def test_host_chain_arithmetic_median_per_layer():
    clock = _FakeClock()
    costs = iter([0.010] * 3 + [0.002] + [0.0024, 0.0048, 0.0012, 0.0036, 0.0030])  # warm-up, estimate, 5 reps
    resets = []

    def step():
        clock.t += next(costs)

    busy = _FakeBusy(clock)
    m = hc.measure(step, busy, layers=24, reps=5, warmup=3, reset=lambda: resets.append(1), clock=clock)
    assert m["valid"] and m["invalid_reps"] == 0 and m["reps"] == 5
    assert m["us_chain"] == pytest.approx(3000.0) and m["us_per_layer"] == pytest.approx(125.0)
    assert m["unheld_ms"] == pytest.approx(2.0) and busy.holds == [hc.MIN_SLEEP_MS] * 5  # max(50, 4 x 2 ms)
    assert len(resets) == 3 + 1 + 5


def test_host_chain_lengthens_the_hold_when_the_gpu_catches_up():
    clock = _FakeClock()
    costs = iter([0.001, 0.001] + [0.080] + [0.002] * 10)  # one warm-up, estimate, then one repeat issues 80 ms

    def step():
        clock.t += next(costs)

    busy = _FakeBusy(clock)
    m = hc.measure(step, busy, layers=24, reps=3, warmup=1, clock=clock)
    assert m["valid"] and m["invalid_reps"] == 1
    assert busy.holds == [50.0, 200.0, 200.0, 200.0] and m["sleep_ms"] == 200.0
    assert m["us_per_layer"] == pytest.approx(2000.0 / 24)


def test_host_chain_flags_a_chain_that_waits_on_the_gpu_invalid():
    clock = _FakeClock()
    busy = _FakeBusy(clock)

    def syncing_step():  # waits until the GPU is done with whatever was queued (a .item() in the chain)
        clock.t += 0.001 + (busy.holds[-1] * 1e-3 if busy.holds else 0.0)

    m = hc.measure(syncing_step, busy, layers=24, reps=3, warmup=1, clock=clock)
    assert not m["valid"] and m["us_per_layer"] is None
    assert m["invalid_reps"] == hc.MAX_LENGTHEN + 1 and "before the host finished issuing" in m["reason"]
    assert busy.holds == [50.0 * hc.LENGTHEN ** i for i in range(hc.MAX_LENGTHEN + 1)]
    with pytest.raises(ValueError, match="reps >= 1"):
        hc.measure(syncing_step, busy, layers=24, reps=0)


def test_host_chain_rows_and_ratio_on_cpu(monkeypatch):
    """run_host_chain with CPU systems and a fake busy: rows for flashsink, fa4, sdpa; sdpa's chain has no
    window; the ratio is us/layer over sdpa's; the table and the JSON-ready result."""
    _fake_fa4(monkeypatch, [])

    class Fa4CPU(bench.Fa4):
        def check_available(self, device):
            pass

    class SdpaCPU(bench.Sdpa):
        def check_available(self, device):
            pass

    seen = {}

    class FlashsinkLog(bench.FlashSink):
        def forward(self, t, prob):
            seen.setdefault("flashsink", []).append(prob.window)
            return super().forward(t, prob)

    class SdpaLog(SdpaCPU):
        def forward(self, t, prob):
            seen.setdefault("sdpa", []).append(prob.window)
            return super().forward(t, prob)

    registry = {"flashsink": FlashsinkLog, "fa4": Fa4CPU, "sdpa": SdpaLog}
    clock = _FakeClock()
    busy = _FakeBusy(clock)
    cost = {"v": 0.0}
    real = hc.chain_step

    def chain_step(system, prob, inp):  # each system's issue costs a known fake time
        step, reset = real(system, prob, inp)
        per = {"flashsink": 0.0012, "fa4": 0.0024, "sdpa": 0.0016}[system.name]

        def timed():
            step()
            clock.t += per

        return timed, reset

    monkeypatch.setattr(hc, "chain_step", chain_step)
    shape = dict(batch=1, heads=4, kv_heads=2, seq=16, head_dim=16, window=4)
    res = hc.run_host_chain(list(hc.SYSTEMS), device="cpu", dtype="bf16", reps=3, warmup=1, say=lambda m: None,
                            busy=busy, registry=registry, clock=clock, shape=shape, layers=4)
    rows = {r["system"]: r for r in res["rows"]}
    assert all(r["valid"] and r["status"] == "ok" for r in rows.values()), [r["status"] for r in rows.values()]
    assert rows["flashsink"]["us_per_layer"] == pytest.approx(300.0) and rows["sdpa"]["us_per_layer"] == \
        pytest.approx(400.0)
    assert rows["flashsink"]["ratio_to_sdpa"] == pytest.approx(0.75) and rows["fa4"]["ratio_to_sdpa"] == \
        pytest.approx(1.5) and rows["sdpa"]["ratio_to_sdpa"] == pytest.approx(1.0)
    assert set(seen["flashsink"]) == {4, None} and set(seen["sdpa"]) == {None}  # sdpa: causal, no window
    assert rows["sdpa"]["note"] == "no sink" and rows["fa4"]["note"] == ""
    text = hc.format_host_chain(res)
    assert "us/layer" in text and "0.75" in text and "flashsink <= 1.00" in text
    json.dumps(res)
    assert hc.chain_problem().label().startswith("host-chain stack of 24 layers (12 W=128 + 12 full) B=1 N=4096 H=64")
    with pytest.raises(ValueError, match="choose from"):
        hc.run_host_chain(["flex"], device="cpu", say=print, busy=busy)


@pytest.mark.boundary
@pytest.mark.parametrize("argv, needle", [
    (["--host-chain", "--preset", "golden"], "drop --preset"),
    (["--host-chain", "--shape", "1,4,2,16,16", "--mode", "fwd"], "drop --shape, --mode"),
    (["--host-chain", "--systems", "flex"], "--systems with --host-chain: choose from flashsink, fa4, sdpa"),
    (["--host-chain", "--chain-reps", "0"], "--chain-reps must be >= 1"),
    (["--chain-reps", "5"], "--chain-reps goes with --host-chain"),
    (["--chain-reps", "20"], "--chain-reps goes with --host-chain"),
    (["--host-chain", "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json"),
    (["--host-chain"], "--host-chain needs a CUDA GPU"),
])
def test_host_chain_usage_errors_exit_2_before_running(monkeypatch, argv, needle, capsys):
    def never(*a, **kw):
        raise AssertionError("the run started")

    monkeypatch.setattr(bench.command, "run_bench", never)
    monkeypatch.setattr(hc, "run_host_chain", never)
    assert _bench_cli(*argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_help_documents_the_stack_and_host_chain():
    from flashsink.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "--host-chain" in text and "--chain-reps" in text and "gptoss-stack-4k" in text
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "--host-chain" in readme and "gptoss-stack-16k" in readme


@pytest.mark.parametrize("valid", [True, False])
def test_host_chain_cli_writes_json_and_table(monkeypatch, tmp_path, capsys, valid):
    """The command's path past its checks (CUDA faked, the measurement injected): the table on stdout, the
    JSON with the bench's header and the rows, exit 1 when a row is INVALID."""
    from flashsink.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    got = {}

    def fake_run(systems, **kw):
        got.update(kw, systems=systems)
        rows = [{"system": s, "problem": "host-chain p", "layers": 24, "valid": valid or s != "fa4",
                 "us_per_layer": u, "us_chain": u * 24, "reps": kw["reps"], "invalid_reps": 0, "sleep_ms": 50.0,
                 "unheld_ms": 1.0, "status": "ok" if (valid or s != "fa4") else "INVALID: the GPU finished",
                 "note": ""} for s, u in zip(systems, (30.0, 45.0, 40.0))]
        hc.add_ratios(rows)
        return {"mode": "host-chain", "rows": rows, "timing": "fake"}

    monkeypatch.setattr(hc, "run_host_chain", fake_run)
    out = tmp_path / "hc.json"
    rc = main(["bench", "--host-chain", "--chain-reps", "7", "--json", str(out)])
    assert rc == (0 if valid else 1)
    assert got["systems"] == list(hc.SYSTEMS) and got["reps"] == 7 and got["dtype"] == "bf16"
    data = json.loads(out.read_text())
    assert data["header"]["device"] == "Fake GPU" and data["mode"] == "host-chain"
    rows = {r["system"]: r for r in data["rows"]}
    assert rows["flashsink"]["ratio_to_sdpa"] == pytest.approx(0.75)
    assert (rows["fa4"]["ratio_to_sdpa"] is None) == (not valid)
    cap = capsys.readouterr()
    assert "us/layer" in cap.out and "0.75" in cap.out and "calibrating" in cap.err
