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
    assert set(bench.PRESETS) == {"golden", "gptoss-swa", "gptoss-full", "causal-d128"}
    g = bench.preset_problems("golden")[0]
    assert (g.dtype, g.batch, g.heads, g.kv_heads, g.seq_q, g.head_dim, g.window) == ("fp16", 1, 64, 8, 4096, 128, 128)
    assert [p.seq_q for p in bench.preset_problems("gptoss-full")] == [2048, 4096, 8192, 16384]
    p = bench.parse_shape("1,4,2,64:96,32,16", "bf16")
    assert (p.seq_q, p.seq_kv, p.window, p.dtype) == (64, 96, 16, "bf16")
    assert bench.parse_shape("1,4,2,64,32", "fp16").window is None
    with pytest.raises(ValueError):
        bench.parse_shape("1,4,2", "fp16")


class _Wrong(bench.Eager):
    """The reference with its output scaled by 1.05: must fail the gate and never be timed."""

    name = "wrong"
    note = "deliberately wrong"
    calls = 0

    def forward(self, t, prob):
        type(self).calls += 1
        return super().forward(t, prob) * 1.05


def test_gate_fails_wrong_system_and_does_not_time_it(monkeypatch):
    monkeypatch.setitem(bench.SYSTEMS, "wrong", _Wrong)
    _Wrong.calls = 0
    timed = []

    class CountingTimer(bench.Timer):
        def __call__(self, fn):
            timed.append(fn)
            return super().__call__(fn)

    prob = bench.parse_shape("1,4,2,64,32,16", "fp32")
    timer = CountingTimer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench([prob], systems=["flashsink", "wrong"], modes=list(bench.MODES), device="cpu", timer=timer)
    rows = {(r["system"], r["mode"]): r for r in res["rows"]}
    for mode in bench.MODES:
        bad = rows[("wrong", mode)]
        assert bad["status"].startswith("FAIL"), bad
        assert bad["ms"] is None and bad["tflops"] is None
        good = rows[("flashsink", mode)]
        assert good["status"] == "ok" and good["ms"] > 0
    assert _Wrong.calls == 1  # the gate's single forward; no timing call reached it
    assert len(timed) == 2 + 3  # two ceilings, three flashsink modes
    gates = {g["system"]: g for g in res["gates"]}
    assert not all(r["passed"] for r in gates["wrong"]["reports"])
    assert "FAIL" in bench.format_table(res)


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
        else:  # CUDA-only systems are listed with a reason, not dropped
            assert x["status"].startswith("unavailable"), x
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
    monkeypatch.setattr(bench, "_REF_SCORE_ELEMS", 2 * 24 * 24 * 2)  # two query heads per chunk
    parts = bench.reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    for n in ("o", "dq", "dk", "dv", "dsink"):
        torch.testing.assert_close(parts[n], whole[n], rtol=1e-12, atol=1e-12)
