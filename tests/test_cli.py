"""`flashsink check` on CPU with tiny shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashsink import cli

TINY = ["--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--device", "cpu"]
ROWS = ("o", "lse", "dq", "dk", "dv", "dsink")


def _table_rows(text: str):
    return [line for line in text.splitlines() if line.split()[:1] and line.split()[0] in ROWS and ("PASS" in line or "FAIL" in line)]


@pytest.mark.l0
def test_check_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "flashsink", "check", *TINY, "--window", "16", "--seed", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table_rows(proc.stdout)
    assert [r.split()[0] for r in rows] == list(ROWS) * 2, proc.stdout  # precision fast, then strict
    assert [r.split()[3] for r in rows] == ["fast"] * 6 + ["strict"] * 6  # each judged by its own gate
    assert all("PASS" in r for r in rows)
    assert "precision='fast', judged by the fast gate" in proc.stdout
    assert "precision='strict', judged by the precision standard" in proc.stdout
    assert "tensor" in proc.stdout and "max |a-e|" in proc.stdout and "fwd " in proc.stdout and "bwd " in proc.stdout


@pytest.mark.l1
@pytest.mark.parametrize(
    "extra",
    [
        ["--dtype", "bf16", "--window", "none"],
        ["--dtype", "fp32", "--seq-q", "20", "--seq-kv", "50", "--window", "7"],
        ["--no-causal", "--seq-q", "40", "--seq-kv", "24"],
    ],
    ids=["bf16-full", "fp32-NQ20-NK50-W7", "noncausal"],
)
def test_check_in_process(extra, capsys):
    assert cli.main(["check", *TINY, *extra]) == 0
    out = capsys.readouterr().out
    assert len(_table_rows(out)) == 12 and "check passed" in out


@pytest.mark.l0
def test_check_reports_failure(monkeypatch, capsys):
    import flashsink

    real = flashsink.attention

    def wrong(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o * 1.01, lse

    monkeypatch.setattr(flashsink, "attention", wrong)
    assert cli.main(["check", *TINY]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "check FAILED: fast o, " in out and ", strict o, " in out


@pytest.mark.l0
def test_check_runs_each_precision_under_its_gate(monkeypatch, capsys):
    """Both modes run; a mode that is wrong, or raises, fails the check on its own."""
    import flashsink

    real, seen = flashsink.attention, []

    def strict_raises(*args, precision="fast", **kwargs):
        seen.append(precision)
        if precision == "strict":
            raise RuntimeError("no strict kernel")
        return real(*args, precision=precision, **kwargs)

    monkeypatch.setattr(flashsink, "attention", strict_raises)
    assert cli.main(["check", *TINY]) == 1
    out = capsys.readouterr().out
    assert set(seen) == {"fast", "strict"} and len(_table_rows(out)) == 6
    assert "no strict kernel" in out and "check FAILED: strict (raised)" in out


@pytest.mark.boundary
def test_check_bad_options(capsys):
    assert cli.main(["check", *TINY, "--no-causal", "--window", "3"]) == 2
    assert "sliding window needs causal=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["check", "--window", "wide"])


@pytest.mark.l0
def test_cpu_default_is_scaled_down():
    class Args:
        batch = heads = kv_heads = seq = seq_q = seq_kv = head_dim = dtype = None
        window = cli._FROM_BASE
        no_causal = False

    prob, note = cli._resolve_problem(Args, "cpu")
    assert note and "scaled down" in note
    assert (prob["heads"], prob["kv_heads"], prob["seq_q"], prob["head_dim"], prob["window"]) == (16, 2, 512, 128, 128)
    prob, note = cli._resolve_problem(Args, "cuda")
    assert note is None
    assert (prob["batch"], prob["heads"], prob["kv_heads"], prob["seq_q"], prob["head_dim"], prob["window"], prob["dtype"]) == (
        1, 64, 8, 4096, 128, 128, "fp16"
    )


@pytest.mark.boundary
@pytest.mark.parametrize("argv", [
    ["--seq", "-4"], ["--batch", "-1"], ["--heads", "0"], ["--seq-q", "0"], ["--head-dim", "x"],
    ["--seed", str(2 ** 64)], ["--seed", "-1"],
])
def test_check_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--device", "cpu", *argv])
    assert exc.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err
