"""bench/command.py: `flashsink bench` from the command line on the CPU: the smoke runs and their JSON,
the no-CUDA exit, usage errors before any run, the defaults the help states, the precompile plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashsink import bench

from bench_helpers import ROOT, bench_cli

pytestmark = pytest.mark.l1


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


class _Planned(Exception):
    pass


def _planned(monkeypatch, *argv):
    """The problems a bench command would run (its run stopped before any work)."""
    def fake_run(problems, **kw):
        raise _Planned(problems)

    monkeypatch.setattr(bench.command, "run_bench", fake_run)
    with pytest.raises(_Planned) as exc:
        bench_cli(*argv)
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
    assert bench_cli(*argv) == 2
    assert needle in capsys.readouterr().err


def test_bench_seed_beyond_64_bits_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_cli("--seed", str(2 ** 64))
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
    from flashsink.ops.compiler import precompile as precompile_mod

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


def test_help_documents_the_stack_and_host_chain():
    from flashsink.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "--host-chain" in text and "--chain-reps" in text and "gptoss-stack-4k" in text
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "--host-chain" in readme and "gptoss-stack-16k" in readme
