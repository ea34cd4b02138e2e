"""Issue 54, the command line as a newcomer meets it: `check` on a CPU that cannot hold the problem (item 9),
`precompile`'s progress (item 10), `--version` and `--plot` without matplotlib (item 11), and TileLang's own
cache left alone by a compile (item 13)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashsink import cli

ROOT = Path(__file__).resolve().parents[1]


# -- item 9: `flashsink check` ----------------------------------------------------------------------


@pytest.mark.boundary
def test_check_too_big_for_this_cpu_is_one_line_and_exit_1():
    """A shape the CPU cannot hold (the fp64 reference of H=64 N=65536 needs terabytes): one line saying how
    much memory it needs and which option makes it fit, exit status 1, no traceback, nothing allocated."""
    argv = ["check", "--device", "cpu", "--seq", "65536", "--heads", "64", "--kv-heads", "8", "--head-dim", "16"]
    run = subprocess.run([sys.executable, "-m", "flashsink", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert re.match(r"error: this check needs about [\d.]+ GiB of memory on the CPU .* but [\d.]+ GiB is available; "
                    r"--seq \d+ makes it fit", last), last
    assert not run.stdout.strip(), run.stdout  # the error is the whole output


@pytest.mark.boundary
@pytest.mark.parametrize("extra, flag", [([], "--seq"), (["--seq-q", "300", "--seq-kv", "9000"], "--seq-q")])
def test_check_names_the_options_that_fit(monkeypatch, capsys, extra, flag):
    """The suggested options do fit in the memory the machine has (here: 1 GiB)."""
    monkeypatch.setattr(cli, "available_memory", lambda: 2**30)
    assert cli.main(["check", "--device", "cpu", "--seq", "4096", *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this check needs about"), err
    fix = re.search(r"; (--seq(?:-q)? \d+(?: --seq-kv \d+)?) makes it fit", err[0]).group(1)
    assert fix.startswith(flag)
    args = cli.build_parser().parse_args(["check", "--device", "cpu", "--seq", "4096", *extra, *fix.split()])
    prob, _ = cli._resolve_problem(args, "cpu")
    assert cli.cpu_memory_needed(prob) <= 2**30 < cli.cpu_memory_needed(dict(prob, seq_q=prob["seq_q"] + 64,
                                                                              seq_kv=prob["seq_kv"] + 64))


@pytest.mark.l0
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_check_default_values_change_nothing(device):
    """Passing an option its default value gives the same problem as leaving it out (`--batch 1` used to
    turn off the CPU scale-down, checking the full golden problem on the CPU)."""
    base = cli.CPU_SCALED if device == "cpu" else cli.GOLDEN
    defaults = [["--batch", str(base["batch"])], ["--heads", str(base["heads"])],
                ["--kv-heads", str(base["kv_heads"])], ["--seq", str(base["seq"])],
                ["--head-dim", str(base["head_dim"])], ["--dtype", base["dtype"]], ["--window", str(base["window"])],
                ["--seq-q", str(base["seq"])], ["--seq-kv", str(base["seq"])]]
    want, _ = cli._resolve_problem(cli.build_parser().parse_args(["check"]), device)
    for opt in [*defaults, [a for d in defaults[:5] for a in d]]:
        got, _ = cli._resolve_problem(cli.build_parser().parse_args(["check", *opt]), device)
        assert got == want, (opt, got, want)
    got, _ = cli._resolve_problem(cli.build_parser().parse_args(["check", "--heads", "32"]), device)
    assert got == dict(want, heads=32)  # an option changes its own value only


# -- item 10: `flashsink precompile` reports kernels as they finish -----------------------------------


@pytest.mark.l0
def test_precompile_reports_each_kernel_when_it_finishes(monkeypatch, tmp_path):
    """The longest build is submitted first; the kernels finished meanwhile are reported meanwhile (not after
    it), each line with the count done and the time since the start."""
    import concurrent.futures as cf

    from flashsink.ops.compiler import registry as parallel
    from flashsink.ops.compiler import precompile as pc
    from flashsink.kernel_config import KernelConfig

    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "cache"))
    slow_done = threading.Event()

    def compile_one(job):  # the first job submitted (the longest kind) takes 1 s, the others none
        kind, cfg = job
        if kind == "fwd":
            time.sleep(1.0)
            slow_done.set()
        return kind, cfg, 1.0 if kind == "fwd" else 0.0, "compiled", None

    monkeypatch.setattr(parallel, "compile_one", compile_one)
    monkeypatch.setattr(parallel, "executor", lambda jobs: cf.ThreadPoolExecutor(max_workers=jobs))

    class Out(io.StringIO):
        lines: list = []

        def write(self, text):
            if text.startswith("["):
                self.lines.append((text, slow_done.is_set()))
            return super().write(text)

    out = Out()
    cfg = KernelConfig("sm_90a", "bfloat16", 64, 64, 8, True, True, "bhsd", deterministic=False, precision="fast")
    assert pc.precompile([cfg], kinds=("fwd", "preprocess", "postprocess"), jobs=2, out=out) == []
    lines = out.lines
    assert len(lines) == 3, out.getvalue()
    heads = [re.match(r"\[(\d)/3\] (\w+)", t).groups() for t, _ in lines]
    assert [n for n, _ in heads] == ["1", "2", "3"] and heads[-1][1] == "fwd", out.getvalue()
    assert [done for _, done in lines] == [False, False, True]  # the fast ones written while fwd still built
    for text, _ in lines:
        assert re.search(r"ok \(compiled\)\s+\(elapsed \d+ s\)$", text.strip()), text


# -- item 11: --version, --plot without matplotlib ------------------------------------------------------


@pytest.mark.l0
def test_version(capsys):
    from flashsink import __version__

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"flashsink {__version__}"


@pytest.mark.boundary
def test_plot_without_matplotlib_exits_nonzero_with_the_install_command(monkeypatch, capsys, tmp_path):
    """Refused before the run (not a note after minutes of benchmarking), naming the extra that installs it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    argv = ["bench", "--device", "cpu", "--systems", "eager", "--mode", "fwd", "--plot", str(tmp_path / "b.png")]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "pip install 'flashsink[plot]'" in err and "matplotlib" in err, err
    assert not out.strip(), out  # nothing was run
    extras = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^plot = \[\s*"matplotlib', extras, re.M), "pyproject.toml: no `plot` extra with matplotlib"


# -- item 13: TileLang's own cache is not written or read by a compile -----------------------------------


@pytest.mark.l0
@pytest.mark.parametrize("raises", [False, True], ids=["ok", "compile-fails"])
def test_compile_keeps_tilelang_binary_cache_off(monkeypatch, raises):
    """``lowering.jit`` (every flashsink compile, precompile's workers included) runs TileLang's compiler with
    its caches off: its nvcc step would otherwise write each cubin to TILELANG_CACHE_DIR (~/.tilelang/cache)
    and load one found there unchecked. The switch is restored afterwards, also when the compile fails."""
    import importlib

    import tilelang

    from flashsink.ops.compiler import compile as lowering

    jit_module = importlib.import_module("tilelang.jit")  # the module (``tilelang.jit`` is also a function)

    seen = []

    def fake_jit_kernel(func, **kw):
        seen.append(tilelang.is_cache_enabled())
        if raises:
            raise RuntimeError("nvcc failed")
        return "kernel"

    monkeypatch.setattr(jit_module, "JITKernel", fake_jit_kernel)
    cfg = SimpleNamespace(target=lambda: "cuda")
    args = SimpleNamespace(out_idx=None, pass_configs={}, compile_flags=None)
    assert tilelang.is_cache_enabled()
    if raises:
        with pytest.raises(RuntimeError, match="nvcc failed"):
            lowering.jit(None, cfg, args)
    else:
        assert lowering.jit(None, cfg, args) == "kernel"
    assert seen == [False] and tilelang.is_cache_enabled()
    tilelang.disable_cache()  # a user who turned it off keeps it off
    try:
        with pytest.raises(RuntimeError) if raises else _nothing():
            lowering.jit(None, cfg, args)
        assert not tilelang.is_cache_enabled()
    finally:
        tilelang.enable_cache()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.l0
def test_readme_does_not_promise_seconds_for_l0():
    """`pytest -m l0` takes about 100 s on a CPU machine: the README and the marker's description say so."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "pytest -m l0 " in x)
    assert "seconds" not in line and re.search(r"~\d+ s", line), line
    marker = next(x for x in (ROOT / "pyproject.toml").read_text().splitlines() if x.strip().startswith('"l0:'))
    assert "seconds" not in marker and re.search(r"~\d+ s", marker), marker
