"""bench/host_chain.py: `--host-chain` (issue 49's target 5), the host's time per layer with the GPU held
busy, on a fake clock: the arithmetic, the hold lengthened, an invalid chain, the rows and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from flashsink import bench
from flashsink.bench import host_chain as hc

from bench_helpers import bench_cli, fake_fa4

pytestmark = pytest.mark.l1


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
    fake_fa4(monkeypatch, [])

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
    assert bench_cli(*argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


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
