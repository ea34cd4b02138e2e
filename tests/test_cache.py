"""The kernel cache and compile failures, on the CPU (nvcc, no GPU).

- 8 processes that need the same kernel at the same moment: all succeed, one compiles, the
  others wait and load its entry, which is complete and verifies;
- a tampered entry (a flipped byte, an added or missing file, another key) is never loaded;
- a cache directory owned by someone else or writable by group/others is refused;
- ``flashsink.CompileError`` carries the configuration, the target and the compiler's output;
  transient failures are retried, temporary files removed;
- ``FLASHSINK_LOG``, the first-use log line, ``flashsink cache info/clear``, precompile into the cache.

Only three tests compile a kernel (the smallest, ``postprocess``): each costs 10-30 s here.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import shutil
import stat
import tempfile
import traceback

import pytest

import flashsink
from flashsink.cli import main
from flashsink.errors import CacheDirError, CompileError
from flashsink.ops.compiler import compile as C
from flashsink.ops.compiler import diskcache, compile as keys, compile as logs, compile as lowering, compile as retry
from flashsink.kernel_config import KernelConfig

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

CFG = KernelConfig(arch="sm_80", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=1, causal=True,
                   has_sinks=True, layout="bhsd", deterministic=False, precision="strict")
N_PROCS = 8


@pytest.fixture
def fresh_logging():
    """configure_logging runs once per process; let a test run it again, then undo it."""
    logger = logging.getLogger("flashsink")
    level, handlers = logger.level, list(logger.handlers)
    logs._logging_done = False
    logger.setLevel(logging.NOTSET)
    yield logger
    logs._logging_done = False
    logger.setLevel(level)
    logger.handlers[:] = handlers


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ----------------------------------------------------------------------------------------------
# 8 processes, one kernel, one compile

def _race_worker(cache_dir, barrier, queue):
    os.environ["FLASHSINK_CACHE_DIR"] = cache_dir
    os.environ["FLASHSINK_LOG"] = "warning"
    try:
        import tilelang  # noqa: F401  (the slow import happens before the barrier)

        from flashsink.ops.compiler import compile as comp

        barrier.wait(timeout=900)
        kernel = comp.compile_kernel("postprocess", CFG)
        src = hashlib.sha256(kernel.get_kernel_source().encode()).hexdigest()
        queue.put(("ok", dict(comp.counts), src))
    except BaseException as exc:  # reported to the test
        queue.put(("error", repr(exc), traceback.format_exc()))


@pytest.fixture(scope="module")
def raced_cache(tmp_path_factory):
    """A fresh cache dir filled by 8 spawned processes asking for the same kernel at once."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    import multiprocessing as mp

    root = tmp_path_factory.mktemp("race") / "cache"
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(N_PROCS), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(root), barrier, queue)) for _ in range(N_PROCS)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(timeout=120)
    return root, results, [p.exitcode for p in procs]


@pytest.mark.l1
def test_eight_processes_compile_once(raced_cache):
    root, results, exitcodes = raced_cache
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors[0][2]
    assert exitcodes == [0] * N_PROCS
    compiled = sum(r[1].get("compiled", 0) for r in results)
    loaded = sum(r[1].get("disk", 0) for r in results)
    assert (compiled, loaded) == (1, N_PROCS - 1), [r[1] for r in results]
    assert len({r[2] for r in results}) == 1, "the processes got different kernels"
    entries = list((root / "kernels").iterdir())
    assert len(entries) == 1
    manifest, files = diskcache.verify_entry(entries[0])  # complete: every file, every checksum
    assert set(files) == {"executable.so", "device_kernel.cu", "host_kernel.cu", "params.json"}
    assert manifest["key"]["kind"] == "postprocess" and manifest["key"]["config"]["arch"] == "sm_80"
    assert list((root / "tmp").iterdir()) == [], "temporary files left behind"
    for d in (root, *(root / s for s in diskcache.SUBDIRS)):
        assert _mode(d) == 0o700, d


@pytest.mark.l1
def test_tampered_entry_is_rebuilt_not_loaded(raced_cache, tmp_path, monkeypatch, caplog, fresh_logging):
    root = tmp_path / "cache"
    shutil.copytree(raced_cache[0], root)
    entry = next((root / "kernels").iterdir())
    so = entry / "executable.so"
    blob = bytearray(so.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    so.write_bytes(bytes(blob))

    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(root))
    loads = []
    real_load = C._load_kernel
    monkeypatch.setattr(C, "_load_kernel", lambda files, *a, **k: loads.append(bytes(files["executable.so"]))
                        or real_load(files, *a, **k))
    before = dict(C.counts)
    caplog.set_level(logging.INFO, logger="flashsink")
    C.compile_kernel("postprocess", CFG)
    assert bytes(blob) not in loads, "a tampered entry was loaded"
    # what compile_kernel returns is the rebuilt entry loaded back (no second host link at its first call)
    assert loads == [so.read_bytes()]
    assert C.counts["rebuilt"] == before.get("rebuilt", 0) + 1
    text = caplog.text
    assert "failed verification (sha256 of executable.so differs" in text
    # the first-use line says what is compiled and why the call is slow
    assert "compiling the postprocess kernel for sm_80-bfloat16-D64x64" in text and "slow" in text
    diskcache.verify_entry(entry)  # rebuilt, complete
    # and now it is a verified hit, logged at debug
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="flashsink")
    C.compile_kernel("postprocess", CFG)
    assert len(loads) == 2 and loads[1] == so.read_bytes()
    assert "loaded the postprocess kernel" in caplog.text
    assert [r.levelno for r in caplog.records if "loaded the" in r.getMessage()] == [logging.DEBUG]


@pytest.mark.l1
def test_precompile_fills_and_reuses_the_cache(raced_cache, tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    shutil.copytree(raced_cache[0], root)
    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(root))
    rc = main(["precompile", "--arch", "sm_80", "--dtype", "bf16", "--head-dim", "64", "--groups", "1",
               "--kinds", "postprocess", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert str(root) in out and "ok (cached)" in out and "1 already cached" in out
    assert len(list((root / "kernels").iterdir())) == 1


# ----------------------------------------------------------------------------------------------
# CompileError from a real nvcc failure

@pytest.mark.l1
@needs_nvcc
def test_compile_error_carries_config_target_and_compiler_output(tmp_path, monkeypatch):
    import tilelang

    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "cache"))
    real = keys.pass_configs
    monkeypatch.setattr(keys, "pass_configs", lambda: {
        **real(), tilelang.PassConfigKey.TL_DEVICE_COMPILE_FLAGS: ["--no-such-nvcc-flag"]})
    with pytest.raises(flashsink.CompileError) as info:
        C.compile_kernel("postprocess", CFG)
    err = info.value
    assert err.kind == "postprocess" and err.config == CFG
    assert err.target == {"kind": "cuda", "arch": "sm_80"}
    assert "no-such-nvcc-flag" in err.stderr_tail and "nvcc" in err.stderr_tail
    assert "__global__" not in err.stderr_tail, "the tail should be the compiler's output, not the source"
    assert err.attempts == 1  # an unknown option is not transient
    msg = str(err)
    assert "sm_80-bfloat16-D64x64-G1-causal-sink-bhsd" in msg and "'arch': 'sm_80'" in msg
    root = tmp_path / "cache"
    assert list((root / "kernels").iterdir()) == [] and list((root / "tmp").iterdir()) == []


@pytest.mark.l0
def test_frontend_error_is_a_compile_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "cache"))

    def broken(kind, cfg):
        raise TypeError("store_rows() missing 1 required positional argument: 'cols'")

    monkeypatch.setattr(keys, "build_prim_func", broken)
    with pytest.raises(CompileError, match="missing 1 required positional argument") as info:
        C.compile_kernel("fwd", CFG)
    assert "TypeError" in info.value.stderr_tail and info.value.kind == "fwd"


@pytest.mark.l0
def test_compile_error_pickles():
    import pickle

    err = CompileError("bwd", CFG, CFG.target(), "nvcc fatal: boom", attempts=3)
    back = pickle.loads(pickle.dumps(err))
    assert (back.kind, back.config, back.target, back.stderr_tail, back.attempts) == (
        "bwd", CFG, CFG.target(), "nvcc fatal: boom", 3)
    assert str(back) == str(err) and "after 3 attempts" in str(err)


# ----------------------------------------------------------------------------------------------
# retries and temporary files (the compile step replaced, so nothing is really compiled)

class _Kernel(str):
    """What a compile returns, as far as ``_compile_with_retries`` reads it: its CUDA source."""

    def get_kernel_source(self):
        return self.source

    source = "__global__ void k() { if (tl::tl_shuffle_elect<128>()) {} }"


def _flaky_jit(failures, made, kernel=None):
    calls = []

    def jit(func, cfg, args):
        calls.append(1)
        # what a compile leaves in the temporary directory; must be gone afterwards
        fd, path = tempfile.mkstemp(suffix=".cu")
        os.close(fd)
        made.append(path)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return kernel or _Kernel("kernel")

    return jit, calls


KILLED = RuntimeError("__global__ void k() {}\nCompilation error:\nnvcc error   : 'cicc' died due to signal 9 (Kill signal)\nCommand: nvcc")
NO_SPACE = OSError(errno.ENOSPC, "No space left on device")
SYNTAX = RuntimeError("// Killed in the source is not a verdict\nCompilation error:\nk.cu(3): error: expected a ';'\nCommand: nvcc")


@pytest.mark.l0
@pytest.mark.parametrize("exc, transient", [
    (KILLED, True), (NO_SPACE, True), (MemoryError(), True), (SYNTAX, False),
    (TypeError("bad argument"), False), (RuntimeError("wrapped"), True),
], ids=["killed", "enospc", "memory", "syntax", "typeerror", "cause-enospc"])
def test_transient_classification(exc, transient):
    if str(exc) == "wrapped":
        exc.__cause__ = NO_SPACE
    assert retry.is_transient(exc) is transient


@pytest.mark.l0
def test_transient_failures_are_retried_with_a_log_line(tmp_path, monkeypatch, caplog):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    made = []
    jit, calls = _flaky_jit([NO_SPACE, KILLED], made)
    monkeypatch.setattr(lowering, "jit", jit)
    monkeypatch.setattr(retry, "RETRY_DELAY_S", 0.0)
    tempdir_before, tmpdir_env = tempfile.tempdir, os.environ.get("TMPDIR")
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert retry.compile_with_retries("fwd", CFG, None, None, root) == "kernel"
    assert len(calls) == 3
    retries = [r.getMessage() for r in caplog.records if "transient" in r.getMessage()]
    assert len(retries) == 2 and "retry 1 of 2" in retries[0] and "retry 2 of 2" in retries[1]
    assert "No space left on device" in retries[0] and "died due to signal 9" in retries[1]
    assert all(str(root / "tmp") in p for p in made), "compiles must write their temporary files in the cache's tmp/"
    assert not any(os.path.exists(p) for p in made) and list((root / "tmp").iterdir()) == []
    assert tempfile.tempdir == tempdir_before and os.environ.get("TMPDIR") == tmpdir_env


@pytest.mark.boundary
def test_retries_are_bounded(tmp_path, monkeypatch):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    made = []
    jit, calls = _flaky_jit([NO_SPACE] * 10, made)
    monkeypatch.setattr(lowering, "jit", jit)
    monkeypatch.setattr(retry, "RETRY_DELAY_S", 0.0)
    with pytest.raises(CompileError) as info:
        retry.compile_with_retries("bwd", CFG, None, None, root)
    assert len(calls) == 1 + retry.COMPILE_RETRIES == info.value.attempts
    assert "No space left on device" in info.value.stderr_tail
    assert not any(os.path.exists(p) for p in made) and list((root / "tmp").iterdir()) == []


@pytest.mark.boundary
def test_real_errors_are_not_retried(tmp_path, monkeypatch):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    made = []
    jit, calls = _flaky_jit([SYNTAX], made)
    monkeypatch.setattr(lowering, "jit", jit)
    with pytest.raises(CompileError) as info:
        retry.compile_with_retries("dq", CFG, None, None, root)
    assert len(calls) == 1 and info.value.attempts == 1
    assert "expected a ';'" in info.value.stderr_tail and "Killed in the source" not in info.value.stderr_tail
    assert not any(os.path.exists(p) for p in made)


@pytest.mark.l0
def test_a_kernel_that_would_hang_is_a_compile_error(tmp_path, monkeypatch):
    """A kernel whose CUDA elects a lane under a branch of fewer than 32 threads (``elect.sync`` waits
    for lanes that never come: the H200 hang of the first dq_cast kernel, docs/perf-log.md v18) fails its
    compile, not retried, instead of hanging at its first launch; elections over whole warps, warpgroups
    and the block (0) pass."""
    assert lowering.narrow_elections("tl_shuffle_elect<0>() tl_shuffle_elect<32>() tl_shuffle_elect<384>()") == []
    assert lowering.narrow_elections("tl::tl_shuffle_elect<1>() tl::tl_shuffle_elect<16>() tl_shuffle_elect<1>") == [1, 16]
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    hang = _Kernel("kernel")
    hang.source = "if (threadIdx.x == 288) { if (tl::tl_shuffle_elect<1>()) { tl::tma_load(); } }"
    jit, calls = _flaky_jit([], [], kernel=hang)
    monkeypatch.setattr(lowering, "jit", jit)
    with pytest.raises(CompileError) as info:
        retry.compile_with_retries("bwd", CFG, None, None, root)
    assert len(calls) == 1 and "fewer than a warp" in info.value.stderr_tail and "[1]" in info.value.stderr_tail


# ----------------------------------------------------------------------------------------------
# entries: verification (synthetic entries, no compiler needed)

KEY = {"kind": "fwd", "config": {"arch": "sm_90a"}, "versions": {"tilelang": "0.1.15"}}
FILES = {"executable.so": b"\x7fELF" + bytes(range(256)) * 4, "params.json": b"[]", "device_kernel.cu": b"// k"}


def _make_entry(root, key=KEY, files=FILES):
    root = diskcache.ensure_cache_dir(root)
    name = diskcache.entry_name(key["kind"], key)

    def write(d):
        for n, blob in files.items():
            (d / n).write_bytes(blob)

    with diskcache.key_lock(root, name):
        entry = diskcache.store(root, name, key, write, kind=key["kind"], summary="fwd sm_90a-test")
    return root, name, entry


@pytest.mark.l0
def test_verified_entry_loads_exact_bytes(tmp_path):
    root, name, entry = _make_entry(tmp_path / "cache")
    manifest, files = diskcache.load(root, name, KEY)
    assert files == FILES and manifest["key"] == KEY
    assert _mode(entry) == 0o700 and list((root / "tmp").iterdir()) == []


def _flip(entry):
    p = entry / "executable.so"
    b = bytearray(p.read_bytes())
    b[100] ^= 0x40
    p.write_bytes(bytes(b))


def _edit_manifest(entry, change, seal=False):
    """Edit the manifest's fields; ``seal``: and its checksum too (what only someone who can write
    files as you can do)."""
    import json

    p = entry / diskcache.ENTRY_MANIFEST
    m = json.loads(p.read_text())
    change(m)
    p.write_text(diskcache._seal(m) if seal else json.dumps(m))


TAMPER = {
    "flipped-byte": (_flip, "sha256 of executable.so differs"),
    "truncated": (lambda e: (e / "params.json").write_bytes(b"["), "sha256 of params.json differs"),
    "added-file": (lambda e: (e / "evil.so").write_bytes(b"x"), "unexpected ['evil.so']"),
    "missing-file": (lambda e: (e / "device_kernel.cu").unlink(), "missing ['device_kernel.cu']"),
    "symlink": (lambda e: ((e / "params.json").unlink(), (e / "params.json").symlink_to("/etc/hostname")),
                "params.json is not a regular file"),
    "manifest-garbage": (lambda e: (e / diskcache.ENTRY_MANIFEST).write_text("{not json"), "manifest unreadable"),
    "manifest-other-key": (lambda e: _edit_manifest(e, lambda m: m["key"].update(kind="bwd")),
                           "checksum does not match its fields"),
    "manifest-other-key-resealed": (lambda e: _edit_manifest(e, lambda m: m["key"].update(kind="bwd"), seal=True),
                                    "entry name does not match its recorded key"),
}


@pytest.mark.boundary
@pytest.mark.parametrize("how", list(TAMPER))
def test_tampered_entry_is_a_miss(tmp_path, caplog, how):
    root, name, entry = _make_entry(tmp_path / "cache")
    tamper, reason = TAMPER[how]
    tamper(entry)
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert diskcache.load(root, name, KEY) is None
    assert "failed verification" in caplog.text and reason in caplog.text and "not loading it" in caplog.text
    assert not entry.exists(), "a bad entry must be removed so it is rebuilt"


@pytest.mark.boundary
def test_entry_is_bound_to_its_key(tmp_path):
    """An entry copied under another key's name is refused (recorded key / name mismatch)."""
    root, name, entry = _make_entry(tmp_path / "cache")
    other = dict(KEY, kind="bwd")
    other_name = diskcache.entry_name("bwd", other)
    shutil.copytree(entry, root / "kernels" / other_name)
    assert diskcache.load(root, other_name, other) is None
    assert diskcache.load(root, name, KEY) is not None


@pytest.mark.l0
def test_key_changes_with_every_static_choice():
    """Different kind, config field, tiles, TIR, versions -> different entry names."""
    base = {"kind": "fwd", "config": {"arch": "sm_90a", "head_dim": 64}, "tir_sha256": "a", "versions": {"nvcc": "13.0"}}
    variants = [
        dict(base, kind="bwd"), dict(base, config={"arch": "sm_90a", "head_dim": 128}),
        dict(base, tir_sha256="b"), dict(base, versions={"nvcc": "12.8"}),
    ]
    names = {diskcache.entry_name(k["kind"], k) for k in [base, *variants]}
    assert len(names) == 5
    assert diskcache.entry_name("fwd", dict(reversed(list(base.items())))) == diskcache.entry_name("fwd", base)


# ----------------------------------------------------------------------------------------------
# the directory: created private, refused when it is not

@pytest.mark.l0
def test_cache_dir_is_created_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        root = diskcache.ensure_cache_dir(tmp_path / "a" / "cache")
    finally:
        os.umask(old)
    for d in (root, *(root / s for s in diskcache.SUBDIRS)):
        assert _mode(d) == 0o700, d


@pytest.mark.l0
def test_default_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHSINK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert diskcache.cache_dir() == tmp_path / "xdg" / "flashsink"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert diskcache.cache_dir() == tmp_path / "home" / ".cache" / "flashsink"
    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "mine"))
    assert diskcache.cache_dir() == tmp_path / "mine"


@pytest.mark.boundary
@pytest.mark.parametrize("where", ["root", "kernels"])
def test_group_writable_dir_is_refused(tmp_path, monkeypatch, where):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    target = root if where == "root" else root / "kernels"
    os.chmod(target, 0o775)
    with pytest.raises(CacheDirError, match=r"writable by group or others \(mode 0775\).*chmod go-w"):
        diskcache.ensure_cache_dir(root)
    # the same refusal from a kernel request, before anything is compiled
    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(root))
    with pytest.raises(CacheDirError, match="refuses"):
        C.compile_kernel("postprocess", CFG)


@pytest.mark.boundary
def test_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    owner = os.stat(root).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # as if we were someone else
    with pytest.raises(CacheDirError, match=rf"owned by .*uid {owner}.*not by you.*FLASHSINK_CACHE_DIR"):
        diskcache.ensure_cache_dir(root)
    assert isinstance(CacheDirError("x"), PermissionError) and flashsink.CacheDirError is CacheDirError


@pytest.mark.boundary
def test_file_instead_of_dir_is_refused(tmp_path):
    p = tmp_path / "file"
    p.write_text("")
    with pytest.raises(CacheDirError, match="cannot create|not a directory"):
        diskcache.ensure_cache_dir(p)


# ----------------------------------------------------------------------------------------------
# FLASHSINK_LOG

@pytest.mark.l0
@pytest.mark.parametrize("value, level", [
    ("debug", logging.DEBUG), ("INFO", logging.INFO), ("warning", logging.WARNING), ("error", logging.ERROR),
    ("off", logging.CRITICAL + 10), ("", logging.INFO),
])
def test_flashsink_log_sets_the_level(monkeypatch, fresh_logging, value, level):
    monkeypatch.setenv("FLASHSINK_LOG", value)
    logs.configure_logging()
    assert fresh_logging.level == level


@pytest.mark.l0
def test_application_level_is_kept_without_flashsink_log(monkeypatch, fresh_logging):
    monkeypatch.delenv("FLASHSINK_LOG", raising=False)
    fresh_logging.setLevel(logging.ERROR)  # the application's choice
    logs.configure_logging()
    assert fresh_logging.level == logging.ERROR


@pytest.mark.boundary
def test_flashsink_log_bad_value_warns(monkeypatch, fresh_logging, caplog):
    monkeypatch.setenv("FLASHSINK_LOG", "loud")
    with caplog.at_level(logging.WARNING, logger="flashsink"):
        logs.configure_logging()
        assert fresh_logging.level == logging.INFO
    assert "FLASHSINK_LOG='loud'" in caplog.text


# ----------------------------------------------------------------------------------------------
# flashsink cache info / clear

def _tty(monkeypatch, is_tty: bool, answer: str = ""):
    stdin = io.StringIO(answer + "\n")
    stdin.isatty = lambda: is_tty
    monkeypatch.setattr("sys.stdin", stdin)


@pytest.mark.l0
def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    root, name, entry = _make_entry(tmp_path / "cache")
    (root / "unrelated.txt").write_text("mine")  # clear must not touch what is not the cache's
    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(root))

    assert main(["cache", "info", "-v"]) == 0
    out = capsys.readouterr().out
    assert f"flashsink kernel cache: {root} (FLASHSINK_CACHE_DIR)" in out
    assert "1 entries" in out and "fwd" in out and "sm_90a-test" in out and " ok" in out and name in out

    _flip(entry)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "1 failing verification" in out and "CORRUPT: sha256 of executable.so differs" in out

    _tty(monkeypatch, False)
    assert main(["cache", "clear"]) == 2
    assert "pass --yes" in capsys.readouterr().err and entry.exists()

    _tty(monkeypatch, True, "n")
    assert main(["cache", "clear"]) == 1 and entry.exists()
    capsys.readouterr()

    assert main(["cache", "clear", "--yes"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert list((root / "kernels").iterdir()) == [] and list((root / "tmp").iterdir()) == []
    assert list((root / "locks").iterdir()) == [] and (root / "unrelated.txt").read_text() == "mine"

    assert main(["cache", "info", "--dir", str(root)]) == 0
    assert "0 entries" in capsys.readouterr().out


@pytest.mark.boundary
def test_cache_info_missing_and_unsafe(tmp_path, capsys):
    assert main(["cache", "info", "--dir", str(tmp_path / "none")]) == 0
    assert "does not exist yet" in capsys.readouterr().out
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    os.chmod(root, 0o777)
    assert main(["cache", "info", "--dir", str(root)]) == 2
    assert "UNSAFE" in capsys.readouterr().err
    assert main(["cache", "clear", "--yes", "--dir", str(root)]) == 2


def test_key_holds_its_own_kinds_tiles_only(monkeypatch):
    """keys.cache_key: the tiles entry is the kind's own tile function's answer (none for a kind of fixed
    blocks), so changing another kind's tile function leaves the key, and every kernel cached or bundled
    under it, as it was; changing its own is a new key."""
    import dataclasses

    from flashsink.ops.compiler import compile as comp
    from flashsink.ops.compiler import kinds
    from flashsink.kernel_config import KernelConfig, Tiles

    cfg = KernelConfig("sm_90a", "bfloat16", 64, 64, 8, True, True, "bhsd", deterministic=False, precision="strict")
    func = comp.build_prim_func("merge_splits", cfg)
    args = comp.compile_args(func)

    def key(kind):
        return comp.cache_key(kind, kinds.canonical(kind, cfg), func, args)

    assert key("fwd")["tiles"] == {"fwd_tiles": dataclasses.asdict(kinds.KINDS["fwd"].tiles(cfg))}
    assert key("merge_splits")["tiles"] == {}
    before = {k: key(k) for k in ("fwd", "bwd", "merge_splits")}
    monkeypatch.setitem(kinds.KINDS, "bwd", dataclasses.replace(kinds.KINDS["bwd"], tiles=lambda c: Tiles(8, 8, 32, 1)))
    assert key("fwd") == before["fwd"] and key("merge_splits") == before["merge_splits"]
    assert key("bwd") != before["bwd"]
