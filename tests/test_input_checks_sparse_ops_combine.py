"""Issue 47, items 10-13: input and CLI defects found with the cache review (CPU only).

10. a sparse tensor is refused by name (TypeError: layout torch.strided required);
11. ``torch.ops.flashsink.*`` check their arguments' values as the public functions do, same error
    types and text, inside the ops' implementations; a wrong type is torch's schema error naming the
    argument (issue 52: the ops are plain torch ops, no check before the schema);
12. ``flashsink.combine``: ``-inf`` in a partial's lse is an empty partial (valid); ``+inf`` / NaN is a
    ValueError naming the tensor;
13. ``flashsink bench``: usage errors exit 2 with one line, before any work.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashsink
import flashsink.ops.launch.custom_ops  # noqa: F401  (registers torch.ops.flashsink.*)
from flashsink.cli import main

F32 = torch.float32


def _qkv(seed=0, b=1, h=2, s=8, d=16, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)
    shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    return [torch.randn(shape, generator=g, dtype=F32) for _ in range(3)]


def _error(fn):
    try:
        fn()
    except Exception as exc:  # what the test compares
        return type(exc), str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# 10. sparse inputs

@pytest.mark.boundary
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_item10_sparse_input_is_refused_by_name(name):
    q, k, v = _qkv()
    flashsink.attention(q, k, v, None)  # a dense call first: its validation is remembered, by shape
    args = {"q": q, "k": k, "v": v}
    args[name] = args[name].to_sparse()
    with pytest.raises(TypeError, match=rf"^{name} must be a dense tensor \(layout torch.strided\), got layout "
                                        r"torch.sparse_coo; convert it with .to_dense\(\)"):
        flashsink.attention(args["q"], args["k"], args["v"], None)


@pytest.mark.boundary
def test_item10_sparse_sinks_varlen_and_combine_are_refused():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="^sinks must be a dense tensor"):
        flashsink.attention(q, k, v, torch.randn(2).to_sparse())
    t = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="^q must be a dense tensor"):
        flashsink.attention_varlen(t.to_sparse(), t, t, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="^cu_seqlens_q must be a dense tensor"):
        flashsink.attention_varlen(t, t, t, cu.to_sparse(), cu, 6, 6)
    lse = torch.randn(1, 2, 8)
    with pytest.raises(TypeError, match=r"^outs\[0\] must be a dense tensor"):
        flashsink.combine([q.to_sparse()], [lse])


# ----------------------------------------------------------------------------------------------
# 11. the custom ops validate as the public functions do

def _fwd_args(**change):
    q, k, v = _qkv(1)
    args = dict(q=q, k=k, v=v, sinks=None, window=None, causal=True, scale=0.25, layout="bhsd",
                deterministic=False, precision="fast")
    args.update(change)
    return args


OP_CASES = {  # the op's bad argument -> the public call that must fail the same way
    "precision-bogus": (dict(precision="bogus"), dict(precision="bogus")),
    "window-zero": (dict(window=0), dict(window=0)),
    "layout-bogus": (dict(layout="sbhd"), dict(layout="sbhd")),
    "scale-nan": (dict(scale=float("nan")), dict(scale=float("nan"))),
    "q-int64": (dict(q=torch.zeros(1, 2, 8, 16, dtype=torch.int64)), dict(q=torch.zeros(1, 2, 8, 16, dtype=torch.int64))),
}

# Types the op's schema refuses before any implementation runs: torch's RuntimeError names the argument.
SCHEMA_CASES = {
    "causal-str": dict(causal="yes"),
    "scale-str": dict(scale="x"),
    "layout-int": dict(layout=3),
    "window-float": dict(window=2.5),
    "q-str": dict(q="q"),
    "sinks-list": dict(sinks=[0.0, 0.0]),
}

# What the schema converts (Python's bool is an int; None is a false bool): the op runs as with the
# converted value. flashsink.attention refuses these by name; the op cannot see them.
CONVERTED_CASES = {
    "causal-int": (dict(causal=1), dict(causal=True)),
    "deterministic-none": (dict(deterministic=None), dict(deterministic=False)),
    "window-bool": (dict(window=True), dict(window=1)),
}


@pytest.mark.boundary
@pytest.mark.parametrize("case", list(OP_CASES))
def test_item11_fwd_op_validates_as_attention(case):
    op_change, public_change = OP_CASES[case]
    a = _fwd_args(**public_change)
    public = _error(lambda: flashsink.attention(a["q"], a["k"], a["v"], a["sinks"], window=a["window"],
                                                causal=a["causal"], scale=a["scale"], layout=a["layout"],
                                                deterministic=a["deterministic"], precision=a["precision"]))
    assert public is not None and public[0] in (TypeError, ValueError), public
    op = _error(lambda: torch.ops.flashsink.fwd(*_fwd_args(**op_change).values()))
    assert op == public, f"torch.ops.flashsink.fwd: {op}; flashsink.attention: {public}"
    kw = _error(lambda: torch.ops.flashsink.fwd(**_fwd_args(**op_change)))
    assert kw == public


@pytest.mark.boundary
@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_item11_fwd_op_wrong_types_are_the_schemas_errors(case):
    change = SCHEMA_CASES[case]
    (name,) = change
    with pytest.raises(RuntimeError, match=f"argument '{name}'"):
        torch.ops.flashsink.fwd(*_fwd_args(**change).values())
    with pytest.raises((TypeError, ValueError), match=f"^{name}"):  # the public function names it its own way
        a = _fwd_args(**change)
        flashsink.attention(a["q"], a["k"], a["v"], a["sinks"], window=a["window"], causal=a["causal"],
                            scale=a["scale"], layout=a["layout"])


@pytest.mark.boundary
@pytest.mark.parametrize("case", list(CONVERTED_CASES))
def test_item11_fwd_op_runs_what_the_schema_converts(case):
    given, converted = CONVERTED_CASES[case]
    o, lse = torch.ops.flashsink.fwd(*_fwd_args(**given).values())
    o2, lse2 = torch.ops.flashsink.fwd(*_fwd_args(**converted).values())
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.boundary
def test_item11_ops_are_plain_torch_ops():
    """Issue 52: torch.ops.flashsink.* are the packets torch made, not a subclass of flashsink's."""
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "kvcache_fwd"):
        assert type(getattr(torch.ops.flashsink, name)) is type(torch.ops.aten.add), name


@pytest.mark.boundary
def test_item11_other_ops_validate_in_their_implementations():
    q, k, v = _qkv(2)
    o, lse = torch.ops.flashsink.fwd(q, k, v, None, None, True, 0.25, "bhsd", False)
    with pytest.raises(ValueError, match=r"^window must be >= 1"):
        torch.ops.flashsink.bwd(torch.randn_like(o), q, k, v, None, lse, None, 0, True, 0.25, "bhsd", False)
    with pytest.raises(ValueError, match=r"^precision must be one of \('fast', 'strict'\), got 'bogus'$"):
        torch.ops.flashsink.bwd(torch.randn_like(o), q, k, v, None, lse, None, None, True, 0.25, "bhsd", False,
                                "bogus", o)
    with pytest.raises(ValueError, match="^precision must be one of"):  # through the overload too
        torch.ops.flashsink.fwd.default(q, k, v, None, None, True, 0.25, "bhsd", False, "bogus")
    t = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q must have dtype int32 or int64, got torch.float32"):
        torch.ops.flashsink.varlen_fwd(t, t, t, None, cu.float(), cu, 6, 6, None, True, 0.25, False)
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'"):  # a list: the schema's error
        torch.ops.flashsink.varlen_fwd(t, t, t, None, [0, 4, 10], cu, 6, 6, None, True, 0.25, False)
    with pytest.raises(RuntimeError, match="argument 'q'"):
        torch.ops.flashsink.kvcache_fwd("q", t, t, cu, None, None, None, 0.25, "bshd")
    # and a good call still runs
    o2, _ = torch.ops.flashsink.fwd(q, k, v, None, None, True, 0.25, "bhsd", False, "strict")
    assert torch.equal(o2, o)


# ----------------------------------------------------------------------------------------------
# 12. combine: -inf is an empty partial, +inf / NaN a ValueError naming the tensor

def _partials(seed=3, n=3):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(n)]
    lses = [torch.randn(1, 2, 4, generator=g, dtype=torch.float64) for _ in range(n)]
    return outs, lses


@pytest.mark.boundary
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["+inf", "nan"])
def test_item12_combine_refuses_posinf_and_nan_lse(value):
    outs, lses = _partials()
    lses[2][0, 1, 3] = value
    with pytest.raises(ValueError, match=r"^lses\[2\] must hold finite values or -inf .* 1 entries \+inf or NaN, "
                                         r"the first at \[b, h, s\] = \[0, 1, 3\]"):
        flashsink.combine(outs, lses, torch.tensor([0.5, -0.5], dtype=torch.float64))


@pytest.mark.boundary
def test_item12_combine_neginf_lse_is_an_empty_partial():
    outs, lses = _partials()
    sinks = torch.tensor([0.5, -0.5], dtype=torch.float64)
    want_o, want_lse = flashsink.combine(outs[:2], lses[:2], sinks, return_lse=True)
    lses[2] = torch.full_like(lses[2], -math.inf)  # the third range held no key for any row
    outs[2] = torch.full_like(outs[2], math.nan)  # its o is garbage: ignored where lse is -inf
    o, lse = flashsink.combine(outs, lses, sinks, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# 13. bench usage errors: exit 2, one line, before any work

@pytest.fixture
def no_run(monkeypatch):
    from flashsink.bench import command

    def ran(*a, **k):
        raise AssertionError("the bench ran before refusing its options")

    monkeypatch.setattr(command, "run_bench", ran)


def _one_line_usage_error(capsys, argv):
    try:
        rc = main(["bench", "--device", "cpu", *argv])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    return err


@pytest.mark.boundary
def test_item13_bench_json_to_a_device_is_refused_first(capsys, no_run):
    err = _one_line_usage_error(capsys, ["--json", "/dev/full"])
    assert err == ["error: --json /dev/full: not a regular file (a device, FIFO or socket); give a file path"]


@pytest.mark.boundary
@pytest.mark.parametrize("argv, text", [
    (["--shape", ""], "--shape wants B,H,HKV,N,D[,W], got ''"),
    (["--seq", ""], "--seq wants comma-separated lengths"),
])
def test_item13_bench_empty_shape_or_seq_is_refused(capsys, no_run, argv, text):
    err = _one_line_usage_error(capsys, argv)
    assert len(err) == 1 and text in err[0], err


@pytest.mark.boundary
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e999", "x"])  # "x": a guard (argparse refused it at afa447d too)
def test_item13_bench_eager_max_gib_must_be_a_finite_number_ge_0(capsys, no_run, value):
    err = _one_line_usage_error(capsys, ["--eager-max-gib", value])
    assert "argument --eager-max-gib" in err[-1], err


@pytest.mark.boundary
def test_item13_bench_json_write_failure_is_one_line(capsys, monkeypatch, tmp_path):
    """A write that fails during the run (disk full) is one line and exit 1, not a traceback."""
    from flashsink.bench import command

    def run(problems, *, result, on_problem, **kw):
        result.update(rows=[], ceilings={})
        on_problem(result)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(command, "run_bench", run)
    monkeypatch.setattr(command.json, "dump", full)
    rc = main(["bench", "--device", "cpu", "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1] == f"error: could not write --json {tmp_path / 'out.json'}: No space left on device"
