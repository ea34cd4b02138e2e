"""Issue 54, items 1-6 and 15: the kernel cache survives any file it finds, and a compile touches nothing
of the user's process (CPU only; synthetic entries, and the one compile here is a fake).

1. a manifest or tmp marker that is valid JSON of the wrong shape (nested 100,000 deep, a NUL in a file
   name, a pid no process has) is a bad entry or a foreign directory, never a traceback, for ``load``,
   ``store``, ``cache info`` and ``cache clear``;
2. an entry file is never read past the size its manifest records;
3. no command follows a symbolic link inside the cache;
4. ``cache clear`` works on a cache without ``tmp/`` or ``locks/``;
5. ``cache info`` and ``cache clear`` print what they found escaped (terminal escapes, bidi overrides,
   undecodable file names), whatever the terminal's encoding;
6. ``ensure_cache_dir`` refuses a path with a NUL byte with ``CacheDirError``, a path of the wrong type
   with ``TypeError`` naming it;
15. a compile changes neither the temporary directory nor ``TMPDIR`` of the calling process: another
    thread's temporary files made meanwhile land where they always do and stay there.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import tempfile
import threading
import time

import pytest

from flashsink.cli import main
from flashsink.errors import CacheDirError
from flashsink.ops.compiler import diskcache

KEY = {"kind": "fwd", "config": {"arch": "sm_90a"}, "versions": {"tilelang": "0.1.15"}}
FILES = {"executable.so": b"\x7fELF" + bytes(range(256)) * 4, "params.json": b"[]", "device_kernel.cu": b"// k"}
DEEP = b"[" * 100_000 + b"]" * 100_000  # valid JSON, nested 100,000 deep


def _make_entry(root, key=KEY, files=FILES, kind="fwd", summary="fwd sm_90a-test"):
    root = diskcache.ensure_cache_dir(root)
    name = diskcache.entry_name(kind, key)

    def write(d):
        for n, blob in files.items():
            (d / n).write_bytes(blob)

    with diskcache.key_lock(root, name):
        entry = diskcache.store(root, name, key, write, kind=kind, summary=summary)
    return root, name, entry


def _sealed(record: dict) -> str:
    """``record`` sealed as this flashsink seals (what someone who writes as you could do)."""
    seal = getattr(diskcache, "_seal", None)
    return seal(record) if seal else json.dumps(record)


def _cli(argv, *, encoding="utf-8"):
    """``main(argv)`` with stdout and stderr as streams of ``encoding`` (strict, as a terminal's); returns
    (exit status, stdout, stderr)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict")
    real = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        rc = main(argv)
    finally:
        sys.stdout, sys.stderr = real
    out.flush()
    err.flush()
    return rc, out.buffer.getvalue().decode(encoding), err.buffer.getvalue().decode(encoding)


def _every_command(root, name, entry, caplog):
    """load, cache info, cache clear and store on ``root`` whose entry ``entry`` is bad: none raises, the
    entry is listed as failing, moved out of kernels/ by load (so it is rebuilt), and a new entry stores."""
    rc, out, err = _cli(["cache", "info", "--dir", str(root)])
    assert rc == 0 and "CORRUPT" in out, (out, err)
    rc, out, err = _cli(["cache", "clear", "--yes", "--dir", str(root)])
    assert rc == 0, (out, err)
    caplog.set_level(logging.WARNING, logger="flashsink")
    if entry.exists():  # clear left it alone (no valid manifest names its files): load moves it out
        assert diskcache.load(root, name, KEY) is None
        assert "failed verification" in caplog.text
        assert not entry.exists(), "a bad entry must be moved out of kernels/ so it is rebuilt"
    _make_entry(root, key={**KEY, "config": {"arch": "sm_80"}})  # store (and its tmp/ sweep) still works


# ----------------------------------------------------------------------------------------------
# 1. valid JSON, wrong shape

@pytest.mark.boundary
@pytest.mark.parametrize("where", ["whole-file", "inside-a-field"])
def test_item1_deeply_nested_manifest_is_a_corrupt_entry(tmp_path, caplog, where):
    root, name, entry = _make_entry(tmp_path / "cache")
    manifest = entry / diskcache.ENTRY_MANIFEST
    if where == "whole-file":
        manifest.write_bytes(DEEP)
    else:
        m = json.loads(manifest.read_text())
        text = _sealed(m)
        manifest.write_text(text.replace('"summary"', '"deep": ' + DEEP.decode() + ', "summary"', 1))
    _every_command(root, name, entry, caplog)


@pytest.mark.boundary
@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", "x" * 300])
def test_item1_manifest_naming_an_impossible_file_is_a_corrupt_entry(tmp_path, caplog, bad):
    """A NUL byte, a lone surrogate, a name longer than a file system holds: a sealed manifest listing
    such a file is a bad manifest (load moves the entry out, clear leaves it and lists it)."""
    root, name, entry = _make_entry(tmp_path / "cache")
    p = entry / diskcache.ENTRY_MANIFEST
    m = json.loads(p.read_text())
    m["files"][bad] = {"size": 1, "sha256": "0" * 64}
    p.write_text(_sealed(m))
    _every_command(root, name, entry, caplog)


@pytest.mark.boundary
@pytest.mark.parametrize("marker", [
    DEEP,
    json.dumps({"format": 2, "name": "build-1-x", "pid": 10**30, "host": os.uname().nodename}).encode(),
    json.dumps({"format": 2, "name": "build-1-x", "pid": -1, "host": os.uname().nodename}).encode(),
], ids=["deep", "huge-pid", "pid--1"])
def test_item1_pathological_tmp_marker_is_left_alone(tmp_path, marker):
    """A tmp/ directory whose marker is valid JSON of the wrong shape is not flashsink's: store's sweep and
    clear leave it alone (clear lists it), neither raises."""
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    d = root / "tmp" / "build-1-x"
    d.mkdir(mode=0o700)
    if marker.startswith(b"{"):
        marker = _sealed(json.loads(marker)).encode()
    (d / diskcache.TMP_MARKER).write_bytes(marker)
    old = time.time() - 2 * diskcache.STALE_TMP_SECONDS
    os.utime(d, (old, old))
    _make_entry(root)  # store sweeps tmp/
    assert (d / diskcache.TMP_MARKER).exists()
    rc, out, err = _cli(["cache", "clear", "--yes", "--dir", str(root)])
    assert rc == 0 and "build-1-x: no flashsink marker" in out, (out, err)
    assert (d / diskcache.TMP_MARKER).exists()


# ----------------------------------------------------------------------------------------------
# 2. never read past the recorded size

@pytest.mark.boundary
def test_item2_entry_file_is_not_read_past_its_recorded_size(tmp_path, monkeypatch):
    """params.json records 2 bytes; the file on disk is 64 MiB (sparse). Verifying the entry (load,
    ``cache info``) reads at most the recorded size (+1 to see that it is larger), not the file."""
    root, name, entry = _make_entry(tmp_path / "cache")
    os.truncate(entry / "params.json", 64 << 20)
    read = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(len(b := real_read(fd, n))) or b)
    rc, out, err = _cli(["cache", "info", "--dir", str(root)])
    assert rc == 0 and "CORRUPT" in out and "params.json" in out, (out, err)
    assert sum(read) < 1 << 20, f"cache info read {sum(read)} bytes for an entry whose files record {sum(map(len, FILES.values()))}"
    read.clear()
    assert diskcache.load(root, name, KEY) is None
    assert sum(read) < 1 << 20, f"load read {sum(read)} bytes"


# ----------------------------------------------------------------------------------------------
# 3. no link inside the cache is followed

@pytest.mark.boundary
def test_item3_symlinked_entry_is_neither_walked_nor_sized(tmp_path, monkeypatch):
    """kernels/x -> a directory outside: cache info lists x as bad, with size 0, without walking what it
    points at (here a directory holding a 1 GiB sparse file and a subdirectory); clear leaves it."""
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    with open(outside / "sub" / "big", "wb") as f:
        f.truncate(1 << 30)
    (root / "kernels" / "x").symlink_to(outside)
    walked = []
    real_walk, real_scandir = os.walk, os.scandir
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: walked.append(str(top)) or real_walk(top, *a, **k))
    monkeypatch.setattr(os, "scandir", lambda p=".": walked.append(str(p)) or real_scandir(p))
    found = diskcache.entries(root)
    assert [(e.name, e.size) for e in found] == [("x", 0)] and found[0].status.startswith("CORRUPT")
    assert not [w for w in walked if w.startswith(str(root / "kernels" / "x")) or w.startswith(str(outside))], walked
    rc, out, err = _cli(["cache", "info", "--dir", str(root)])
    assert rc == 0 and "GiB" not in out, out
    rc, out, err = _cli(["cache", "clear", "--yes", "--dir", str(root)])
    assert rc == 0 and (root / "kernels" / "x").is_symlink() and (outside / "sub" / "big").exists()


# ----------------------------------------------------------------------------------------------
# 4. a partial cache

@pytest.mark.boundary
@pytest.mark.parametrize("missing", [("tmp",), ("locks",), ("tmp", "locks"), ("kernels",)])
def test_item4_clear_works_on_a_partial_cache(tmp_path, missing):
    root, name, entry = _make_entry(tmp_path / "cache")
    for sub in missing:
        for p in (root / sub).iterdir():
            assert main(["cache", "clear", "--yes", "--dir", str(root)]) == 0  # empties it first
            break
        os.rmdir(root / sub)
    rc, out, err = _cli(["cache", "info", "--dir", str(root)])
    assert rc == 0, (out, err)
    rc, out, err = _cli(["cache", "clear", "--yes", "--dir", str(root)])
    assert rc == 0 and not err, (out, err)
    assert not (root / "kernels").exists() or list((root / "kernels").iterdir()) == []


# ----------------------------------------------------------------------------------------------
# 5. what a manifest says is printed safely

NASTY = "\x1b]0;owned\x07\x1b[2J\u202egpj.exe \u2603 caf\u00e9"


@pytest.mark.boundary
@pytest.mark.parametrize("encoding", ["utf-8", "ascii", "latin-1"])
def test_item5_cache_info_and_clear_print_escaped(tmp_path, encoding):
    key = {**KEY, "versions": {"tilelang": "0.1\x1b[31m", "nvcc": "\x9b6n"}}
    root, name, entry = _make_entry(tmp_path / "cache", key=key, kind="fwd" + NASTY, summary=NASTY)
    foreign = os.fsdecode(b"evil\x1b[2J\xff")  # a file name that is not UTF-8, with an escape
    (root / "kernels" / foreign).mkdir()
    rc, out, err = _cli(["cache", "info", "-v", "--dir", str(root)], encoding=encoding)
    assert rc == 0, err
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in out, f"{raw!r} printed raw"
    assert "\\x1b]0;owned\\x07" in out and "\\u202egpj.exe" in out and "\\x1b[31m" in out and "\\udcff" in out
    rc, out, err = _cli(["cache", "clear", "--yes", "--dir", str(root)], encoding=encoding)
    assert rc == 0 and "\x1b" not in out and "evil\\x1b[2J\\udcff" in out, (out, err)


# ----------------------------------------------------------------------------------------------
# 6. a path the file system cannot hold

@pytest.mark.boundary
@pytest.mark.parametrize("path", ["cache\x00x", "cache\udcff\ud800"])
def test_item6_unholdable_path_is_a_cache_dir_error(tmp_path, path):
    with pytest.raises(CacheDirError, match="NUL byte"):
        diskcache.ensure_cache_dir(str(tmp_path / path))


@pytest.mark.boundary
@pytest.mark.parametrize("path", [123, b"/tmp/cache"])
def test_item6_path_of_the_wrong_type_is_a_type_error(path):
    with pytest.raises(TypeError, match="path"):
        diskcache.ensure_cache_dir(path)


# ----------------------------------------------------------------------------------------------
# 15. a compile changes nothing of the calling process

class _Func:
    """A stand-in PrimFunc: what compile_kernel reads of one (its TIR text, its attributes)."""

    attrs = None

    def script(self, show_meta=False):
        return "# a fake kernel"


class _Kernel:
    def get_kernel_source(self):
        return "__global__ void k() {}"


def _fake_jit(func, cfg, args):
    """The compiler, faked: its scratch file (which must land in the cache's tmp/) and its seconds."""
    fd, path = tempfile.mkstemp(suffix=".cu")
    os.close(fd)
    scratch_paths.append(path)
    time.sleep(1.5)
    return _Kernel()


def _fake_write(kernel, d):
    for n, blob in FILES.items():
        (d / n).write_bytes(blob)


scratch_paths: list = []


def _child_with_fake_compiler(job):
    """What the compile process runs, with the compiler faked (this module is imported there afresh)."""
    from flashsink.ops.compiler import compile as C
    from flashsink.ops.compiler import compile as keys, compile as lowering

    keys.build_prim_func = lambda kind, cfg: _Func()  # the child builds the kernel's function itself
    lowering.jit = _fake_jit
    C._write_kernel = _fake_write
    if os.environ.get("FS_TEST_STORE_FAILS"):
        def full(*a, **k):
            raise OSError(28, "No space left on device")
        C.diskcache.store = full
    handed = C._child_build(job)
    root = job[4]
    assert scratch_paths and all(p.startswith(str(root / "tmp")) for p in scratch_paths), scratch_paths
    assert not any(os.path.exists(p) for p in scratch_paths)
    return handed


def _fake_compiler(monkeypatch, tmp_path):
    """compile_kernel with the compiler faked, wherever it runs; returns what _load_kernel was given."""
    from flashsink.ops.compiler import compile as C
    from flashsink.ops.compiler import compile as keys, compile as lowering

    monkeypatch.setenv("FLASHSINK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(keys, "build_prim_func", lambda kind, cfg: _Func())
    monkeypatch.setattr(C, "_child_build", _child_with_fake_compiler, raising=False)  # run by the compile process
    monkeypatch.setattr(lowering, "jit", _fake_jit)  # were the compile to run in this process
    monkeypatch.setattr(C, "_write_kernel", _fake_write)
    loaded = []
    monkeypatch.setattr(C, "_load_kernel", lambda files, *a, **k: loaded.append(files) or "kernel")
    return loaded


def _cfg():
    from flashsink.kernel_config import KernelConfig

    return KernelConfig(arch="sm_80", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=1, causal=True,
                        has_sinks=True, layout="bhsd", deterministic=False, precision="strict")


@pytest.mark.l0
def test_item15_compile_leaves_other_threads_temp_files_alone(tmp_path, monkeypatch):
    from flashsink.ops.compiler import compile as C

    loaded = _fake_compiler(monkeypatch, tmp_path)
    cfg = _cfg()

    user_tmp = tmp_path / "user-tmp"
    user_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(user_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    seen, made, stop = set(), [], threading.Event()

    def user_thread():  # another thread of the user's program, making temporary files meanwhile
        while not stop.is_set():
            seen.add((tempfile.gettempdir(), os.environ.get("TMPDIR")))
            with tempfile.NamedTemporaryFile(delete=False) as f:
                made.append(f.name)
            time.sleep(0.01)

    t = threading.Thread(target=user_thread)
    t.start()
    try:
        kernel = C.compile_kernel("fwd", cfg)
    finally:
        stop.set()
        t.join()
    assert kernel == "kernel" and loaded and loaded[-1]["executable.so"] == FILES["executable.so"]
    assert len(made) > 10, "the thread made too few files to tell"
    gone = [p for p in made if not os.path.exists(p)]
    assert not gone, f"{len(gone)} of {len(made)} temporary files another thread made during a compile were deleted"
    assert seen == {(str(user_tmp), str(user_tmp))}, f"the process's temporary directory changed: {seen}"
    assert all(os.path.dirname(p) == str(user_tmp) for p in made)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


@pytest.mark.l0
def test_item15_a_kernel_the_cache_cannot_hold_still_comes_back(tmp_path, monkeypatch, caplog):
    """The compile process compiled the kernel but could not store it (a full disk): it hands the files
    back, compile_kernel loads them and says so; the compile's scratch files are gone all the same."""
    from flashsink.ops.compiler import compile as C

    loaded = _fake_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("FS_TEST_STORE_FAILS", "1")
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert C.compile_kernel("fwd", _cfg()) == "kernel"
    assert loaded and loaded[-1]["executable.so"] == FILES["executable.so"]
    assert "could not save it to the disk cache" in caplog.text and "No space left on device" in caplog.text
    root = tmp_path / "cache"
    assert list((root / "kernels").iterdir()) == [] and list((root / "tmp").iterdir()) == []


# ----------------------------------------------------------------------------------------------
# 14. the test suite leaves nothing in the user's home

_PROBE = '''
import os


def test_caches_are_made_where_the_suite_puts_them():
    from tilelang.env import env

    from flashsink.ops.compiler import diskcache

    diskcache.ensure_cache_dir()  # flashsink's cache, where this environment puts it
    os.makedirs(env.TILELANG_CACHE_DIR, exist_ok=True)  # TileLang's, where a compile writes its files
'''


@pytest.mark.l0
def test_item14_the_suite_leaves_nothing_in_home(tmp_path):
    """tests/conftest.py in charge of a test that makes flashsink's and TileLang's caches where this
    environment puts them, run with HOME an empty directory and neither cache named: HOME stays empty."""
    import pathlib
    import shutil
    import subprocess

    home, probe = tmp_path / "home", tmp_path / "probe"
    home.mkdir()
    probe.mkdir()
    shutil.copy(pathlib.Path(__file__).with_name("conftest.py"), probe / "conftest.py")
    (probe / "test_probe.py").write_text(_PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASHSINK_CACHE_DIR", "TILELANG_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
                         cwd=probe, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    left = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert not left, f"the tests left {len(left)} path(s) in HOME: {left[:8]}"
