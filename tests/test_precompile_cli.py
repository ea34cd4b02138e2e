"""`flashsink precompile`: the configurations it plans, the kernel lists it reads, its errors, the bundle it
packs, and one real build (no GPU)."""

import dataclasses
import io
import os
import shutil
from pathlib import Path

import pytest

from flashsink.cli import main
from flashsink.kernel_config import KernelConfig
from flashsink.ops.compiler.kinds import kinds_for


@pytest.mark.l0
def test_dry_run_plans_the_product(capsys):
    rc = main(["precompile", "--dry-run", "--arch", "sm_90a", "sm_80", "--dtype", "bf16", "fp16",
               "--head-dim", "64", "80", "--groups", "1", "8", "--sinks", "both", "--deterministic"])
    out = capsys.readouterr().out
    assert rc == 0
    # 2 archs x 2 dtypes x 2 tiles (80 runs on the 128 tile) x 2 ratios x 2 sink modes x 2 (det or not),
    # each 4 kernels, plus the split-KV forward and its merge on sm_90a, plus the windowed forward on
    # sm_90a where a GQA group packs (groups 8: config.fwd_window_tiles), 16 configurations
    # bwd_split where the ws main backward runs head-major (D128 Hopper, GQA, not deterministic: 2 dtypes x 2
    # sink modes), none at D64 (config.bwd_head_major)
    assert "64 configurations, 340 kernels" in out
    assert "sm_80-float16-D128x128-G8-causal-nosink-bhsd-det" in out and " dq" in out and " fwd_split" in out
    assert not any(line.startswith("sm_80") and "fwd_split" in line for line in out.splitlines())


@pytest.mark.l0
def test_dry_run_varlen_adds_the_packed_kernels(capsys):
    rc = main(["precompile", "--dry-run", "--dtype", "bf16", "--head-dim", "64", "--groups", "8", "--varlen"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "sm_90a-bfloat16-D64x64-G8-causal-sink-thd" in out
    # bhsd: 4 + the windowed forward + split-KV and merge (the ws main backward runs unsplit); thd: 5
    assert "2 configurations, 12 kernels" in out


@pytest.mark.l0
def test_dry_run_bshd_adds_the_kvcache_kernels(capsys):
    """Causal bshd configurations also build attention_kvcache's paged forward (on sm_80 too)."""
    rc = main(["precompile", "--dry-run", "--arch", "sm_90a", "sm_80", "--dtype", "bf16", "--head-dim", "64",
               "--groups", "8", "--layout", "bshd"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.startswith("sm_")}
    assert lines["sm_90a-bfloat16-D64x64-G8-causal-sink-bshd-fast"][-3:] == ["fwd_split", "merge_splits", "fwd_kvcache"]
    assert lines["sm_80-bfloat16-D64x64-G8-causal-sink-bshd-fast"][-2:] == ["fwd_kvcache", "merge_splits"]


@pytest.mark.boundary
@pytest.mark.parametrize("argv, needle", [
    (["--head-dim", "72"], "--head-dim: 72"),
    (["--head-dim", "512"], "--head-dim: 512"),
    (["--groups", "0"], "--groups: 0"),
])
def test_bad_options_exit_2(argv, needle, capsys):
    assert main(["precompile", "--dry-run", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_builds_a_kernel_without_a_gpu(capsys):
    rc = main(["precompile", "--arch", "sm_80", "--dtype", "bf16", "--head-dim", "64", "--groups", "1",
               "--kinds", "postprocess", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[1/1] postprocess" in out and " ok" in out and "0 failed" in out


@pytest.mark.boundary
@pytest.mark.parametrize("jobs", ["-1", "0", "two"])
def test_jobs_must_be_positive(jobs, capsys):
    # a usage error (argparse: exit 2 with a message), not a traceback, and 0 is not the default
    with pytest.raises(SystemExit) as exc:
        main(["precompile", "--dry-run", "--jobs", jobs])
    assert exc.value.code == 2
    assert "--jobs" in capsys.readouterr().err


@pytest.mark.boundary
def test_fwd_split_on_sm80_is_refused_up_front(capsys):
    # sm_80's code generator rejects the split-KV forward: refused before any compile, dry run included
    assert main(["precompile", "--dry-run", "--arch", "sm_80", "--kinds", "fwd_split"]) == 2
    err = capsys.readouterr().err
    assert "--kinds fwd_split" in err and "sm_80" in err and "fwd preprocess bwd dq postprocess" in err
    assert main(["precompile", "--dry-run", "--varlen", "--kinds", "fwd_split"]) == 2  # thd never splits
    assert main(["precompile", "--dry-run", "--arch", "sm_90a", "--kinds", "fwd_split"]) == 0


@pytest.mark.l0
def test_dry_run_counts_what_is_built(capsys):
    # repeated options plan each configuration (and kind) once, as precompile builds each once
    assert main(["precompile", "--dry-run", "--dtype", "bf16", "--head-dim", "64", "--groups", "8", "8"]) == 0
    assert "1 configurations, 7 kernels" in capsys.readouterr().out
    assert main(["precompile", "--dry-run", "--dtype", "bf16", "--head-dim", "64", "--groups", "8",
                 "--kinds", "fwd", "fwd"]) == 0
    assert "1 configurations, 1 kernels" in capsys.readouterr().out


def test_precompile_refuses_bad_jobs():
    from flashsink.kernel_config import KernelConfig
    from flashsink.ops.compiler.precompile import precompile

    cfg = KernelConfig("sm_80", "bfloat16", 64, 64, 1, True, True, "bhsd", deterministic=False, precision="strict")
    for jobs in (0, -1, 1.5):
        with pytest.raises(ValueError, match="jobs"):
            precompile([cfg], kinds=("postprocess",), jobs=jobs)


def test_precompile_starts_the_longest_builds_first(monkeypatch):
    """The workers take the kinds that build longest first (``Kind.build_s``), each kind's
    configurations in the order given."""
    from flashsink.ops.compiler import precompile as pc
    from flashsink.kernel_config import KernelConfig
    from flashsink.ops.compiler.kinds import KINDS

    seen = []

    def fake_parallel(todo, *, jobs=None):
        seen.extend(todo)
        for kind, cfg in todo:
            yield kind, cfg, 0.0, "cached", None

    monkeypatch.setattr(pc, "compile_parallel", fake_parallel)
    cfgs = [KernelConfig("sm_90a", dt, 64, 64, 8, True, True, "bhsd", deterministic=False, precision="strict") for dt in ("bfloat16", "float16")]
    kinds = ("postprocess", "preprocess", "bwd", "fwd")
    assert pc.precompile(cfgs, kinds=kinds, jobs=2, out=io.StringIO()) == []
    order = [kind for kind, _ in seen]
    assert [KINDS[k].build_s for k in order] == sorted((KINDS[k].build_s for k in order), reverse=True)
    assert order[:2] == ["fwd", "fwd"] and order[-2:] == ["postprocess", "postprocess"]
    assert [cfg.dtype for kind, cfg in seen if kind == "bwd"] == ["bfloat16", "float16"]


def _tool(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps({"kind": k, **dataclasses.asdict(cfg)}) + "\n" for k, cfg in rows))
    return path


def _planned(monkeypatch):
    """What `flashsink precompile` hands to ``precompile`` (which builds nothing here)."""
    from flashsink.ops.compiler import precompile as pc

    got = {}
    monkeypatch.setattr(pc, "precompile", lambda configs, kinds=None, pairs=(), jobs=None, out=None: got.update(
        configs=list(configs), pairs=list(pairs), jobs=jobs) or [])
    return got


REC = KernelConfig("sm_90a", "float16", 64, 64, 3, True, True, "bshd", False, "fast")


@pytest.mark.l0
def test_kernels_and_recorded_files(tmp_path, monkeypatch, capsys):
    """--kernels builds exactly what its file lists; --recorded also the rest of each recorded forward's
    configuration (the recording call stopped at its forward), a forward kind since removed read as
    ``fwd``; no configuration of the option product besides."""
    got = _planned(monkeypatch)
    exact = _jsonl(tmp_path / "kernels.jsonl", [("fwd_window", REC), ("bwd", REC), ("fwd_window", REC)])
    assert main(["precompile", "--kernels", str(exact), "--jobs", "3"]) == 0
    assert got == {"configs": [], "pairs": [("fwd_window", REC), ("bwd", REC)], "jobs": 3}
    assert f"{exact}: 2 kernels" in capsys.readouterr().out
    recorded = _jsonl(tmp_path / "recorded.jsonl", [("fwd_window", REC), ("merge_splits", REC)])
    with recorded.open("a") as f:  # an older run's forward kind
        f.write(recorded.read_text().splitlines()[0].replace('"fwd_window"', '"fwd_pipelined"') + "\n\n")
    assert main(["precompile", "--recorded", str(recorded)]) == 0
    assert got["configs"] == [] and got["pairs"][:3] == [("fwd_window", REC), ("merge_splits", REC), ("fwd", REC)]
    assert set(got["pairs"]) == {("merge_splits", REC)} | {(k, REC) for k in kinds_for(REC)}
    # the dry run lists them per configuration
    assert main(["precompile", "--dry-run", "--kernels", str(exact)]) == 0
    out = capsys.readouterr().out
    assert f"{REC.short():<60} fwd_window bwd" in out and "1 configurations, 2 kernels" in out


def test_the_suites_recorded_kernels_load():
    """tools/suite_recorded.jsonl (the GPU suite's record, read by the kernel bundle) loads as written."""
    from flashsink.ops.compiler.precompile import read_kernels

    path = Path(__file__).resolve().parents[1] / "tools" / "suite_recorded.jsonl"
    pairs = read_kernels(path, recorded=True)
    assert len(pairs) > len(path.read_text().splitlines()) and {cfg.arch for _, cfg in pairs} == {"sm_90a"}


def test_gpu_kernels_lists_the_suite_and_the_bench(tmp_path, monkeypatch, capsys):
    """tools/gpu_kernels.py: the GPU test matrix's kernels, with --bench the bench presets' fast, strict and
    deterministic configurations, each once, as lines `--kernels` reads back."""
    from flashsink.ops.compiler.precompile import read_kernels

    tool = _tool("gpu_kernels")
    monkeypatch.setattr("sys.argv", ["gpu_kernels.py"])
    assert tool.main() == 0
    suite = capsys.readouterr().out
    monkeypatch.setattr("sys.argv", ["gpu_kernels.py", "--bench"])
    assert tool.main() == 0
    both = capsys.readouterr().out
    lines = both.splitlines()
    assert suite.splitlines() == lines[:len(suite.splitlines())] and len(lines) == len(set(lines))
    (tmp_path / "kernels.jsonl").write_text(both)
    pairs = read_kernels(tmp_path / "kernels.jsonl")
    assert len(pairs) == len(lines) and {cfg.arch for _, cfg in pairs} == {"sm_90a"}
    assert ("merge_splits", tool.suite_pairs("sm_90a")[-1][1]) in pairs
    golden = KernelConfig("sm_90a", "float16", 128, 128, 8, True, True, "bhsd", False, "fast")
    for cfg in (golden, dataclasses.replace(golden, precision="strict"),
                dataclasses.replace(golden, deterministic=True)):
        assert {(k, cfg) for k in kinds_for(cfg)} <= set(pairs), cfg.short()


@pytest.mark.boundary
@pytest.mark.parametrize("text, needle", [
    (b"\xff\xfe\n", ":1: not UTF-8 text"),
    (b"\n{oops\n", ":2: not JSON"),
    (b"[1, 2]\n", ":1: expected a JSON object, got list"),
    (b'{"arch": "sm_90a"}\n', ':1: "kind" must be a kernel kind'),
    (b'{"kind": "fwd_pipelined"}\n', ":1: unknown kernel kind 'fwd_pipelined'"),
    (b'{"kind": "fwd"}\n', ":1: missing arch, dtype"),
    (None, ":1: head_dim must be an int >= 1, got '64'"),
    (None, ":1: unknown extra"),
])
def test_a_damaged_file_is_reported_not_raised(text, needle, tmp_path, monkeypatch, capsys):
    """A damaged or foreign line is a usage error (exit 2) naming the option, the file and the line; nothing
    is built."""
    import json

    got = _planned(monkeypatch)
    if text is None:
        row = {"kind": "fwd", **dataclasses.asdict(REC)}
        row.update({"head_dim": "64"} if "head_dim" in needle else {"extra": 1})
        text = (json.dumps(row) + "\n").encode()
    path = tmp_path / "k.jsonl"
    path.write_bytes(text)
    assert main(["precompile", "--kernels", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"flashsink precompile: --kernels {path}{needle}" in err and "Traceback" not in err
    assert main(["precompile", "--recorded", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: cannot read it (No such file or directory)" in capsys.readouterr().err
    assert got == {}


@pytest.mark.boundary
def test_files_take_no_configuration_options(tmp_path, monkeypatch, capsys):
    path = _jsonl(tmp_path / "k.jsonl", [("bwd", REC)])
    assert main(["precompile", "--kernels", str(path), "--arch", "sm_90a", "--varlen"]) == 2
    assert "--arch --varlen cannot be added" in capsys.readouterr().err
    from flashsink.ops.compiler.precompile import pack_bundle, read_kernels

    with pytest.raises(TypeError, match="path must be a path"):
        read_kernels(3)
    with pytest.raises(TypeError, match="path must be a path"):
        pack_bundle(None)


def test_bundle_packs_the_cache_for_the_unpack_script(tmp_path, monkeypatch, capsys):
    """--bundle: the cache's kernels/ in an archive tools/unpack_kernel_bundle.sh unpacks into another
    machine's empty cache; an archive that cannot be written is a message and exit 1."""
    import subprocess

    if shutil.which("bash") is None or shutil.which("xz") is None:
        pytest.skip("needs bash and xz")
    from flashsink.ops.compiler import diskcache

    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "cache"))
    entry = diskcache.ensure_cache_dir() / "kernels" / "bwd-0123"
    entry.mkdir()
    (entry / "params.json").write_text("{}")
    _planned(monkeypatch)
    work = tmp_path / "gpu"
    work.mkdir()
    path = _jsonl(tmp_path / "k.jsonl", [("bwd", REC)])
    assert main(["precompile", "--kernels", str(path), "--bundle", str(work / ".fscache.tar.xz")]) == 0
    assert f"bundle: 1 kernels in {work / '.fscache.tar.xz'}" in capsys.readouterr().out
    assert sorted(p.name for p in work.iterdir()) == [".fscache.tar.xz"]  # no .part left
    script = Path(__file__).resolve().parents[1] / "tools" / "unpack_kernel_bundle.sh"
    env = {"PATH": os.environ["PATH"], "FLASHSINK_CACHE_DIR": str(work / ".fscache")}
    run = subprocess.run(["bash", "-c", f"set -uo pipefail; source {script}"], cwd=work, env=env,
                         capture_output=True, text=True, check=True)
    assert "1 entries unpacked" in run.stdout
    assert (work / ".fscache" / "kernels" / "bwd-0123" / "params.json").read_text() == "{}"
    assert main(["precompile", "--kernels", str(path), "--bundle", str(tmp_path / "no" / "b.tar.xz")]) == 1
    assert "--bundle" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_record_kernels_records_instead_of_building(tmp_path, monkeypatch):
    """pytest --record-kernels (tests/conftest.py): every kernel a launch asks for is appended to the file
    and the call stops; the file is what `flashsink precompile --recorded` reads."""
    from conftest import KernelRecorded, record_kernels

    from flashsink.ops.compiler import registry
    from flashsink.ops.compiler.precompile import read_kernels
    from flashsink.ops.launch import dense

    path = tmp_path / "recorded.jsonl"
    record_kernels(path, monkeypatch)
    with pytest.raises(KernelRecorded, match="recorded fwd_window"):
        dense.get_kernel("fwd_window", REC)  # bound in the launch module at its import
    with pytest.raises(KernelRecorded, match="recorded merge_splits"):
        registry.get_kernel("merge_splits", REC)  # looked up in the registry at the call (decode.py)
    assert read_kernels(path) == [("fwd_window", REC), ("merge_splits", REC)]
    assert ("bwd", REC) in read_kernels(path, recorded=True)


@pytest.mark.parametrize("layout", ["folder", "contents", "dot"])
def test_the_bundle_unpacks_into_the_cache_whatever_its_root(tmp_path, layout):
    """tools/unpack_kernel_bundle.sh: an archive of the cache folder (``tar -cJf .fscache.tar.xz
    .fscache``, the tool's docstring) and one of its contents both land in FLASHSINK_CACHE_DIR/kernels
    (2026-12-05: the first kind unpacked into .fscache/.fscache and the suite compiled every kernel on
    the device); an archive with no kernels says so."""
    import subprocess
    import tarfile

    if shutil.which("bash") is None or shutil.which("xz") is None:
        pytest.skip("needs bash and xz")
    src = tmp_path / "src" / ".fscache" / "kernels" / "fwd-0123"
    src.mkdir(parents=True)
    (src / "params.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    with tarfile.open(work / ".fscache.tar.xz", "w:xz") as tar:
        if layout == "folder":
            tar.add(tmp_path / "src" / ".fscache", arcname=".fscache")
        elif layout == "contents":
            tar.add(tmp_path / "src" / ".fscache" / "kernels", arcname="kernels")
        else:
            tar.add(tmp_path / "src" / ".fscache", arcname=".")
    script = Path(__file__).resolve().parents[1] / "tools" / "unpack_kernel_bundle.sh"
    env = {"PATH": os.environ["PATH"], "FLASHSINK_CACHE_DIR": str(work / ".fscache")}
    run = subprocess.run(["bash", "-c", f"set -uo pipefail; source {script}"], cwd=work, env=env,
                         capture_output=True, text=True, check=True)
    assert (work / ".fscache" / "kernels" / "fwd-0123" / "params.json").read_text() == "{}"
    assert "1 entries unpacked" in run.stdout and not (work / ".fscache" / ".fscache").exists()
    # a second source finds the cache there and leaves it alone
    again = subprocess.run(["bash", "-c", f"source {script}"], cwd=work, env=env, capture_output=True, text=True)
    assert again.stdout == "" and again.returncode == 0
    if layout == "folder":  # no kernels at all: a warning, not silence
        shutil.rmtree(work / ".fscache")
        with tarfile.open(work / ".fscache.tar.xz", "w:xz") as tar:
            tar.add(src / "params.json", arcname="params.json")
        empty = subprocess.run(["bash", "-c", f"source {script}"], cwd=work, env=env, capture_output=True,
                               text=True)
        assert "WARNING" in empty.stderr and "no kernels" in empty.stderr
