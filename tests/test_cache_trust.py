"""Issue 47: the kernel cache's trust and data safety, tried as a hostile local user would (CPU only,
synthetic entries: nothing is compiled).

Each test names the issue's item it covers. The cases that need another user (a directory or symlink
owned by someone else, a file root could read anyway) ``chown`` to an unused uid and run the reader in
a forked child with that uid when the tests run as root; they are skipped otherwise. The FIFO case runs
in a child under a timeout, so a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import pickle
import pwd
import select
import shutil
import signal
import stat
import tempfile
import time
import traceback

import pytest

from flashsink.cli import main
from flashsink.errors import CacheDirError
from flashsink.ops.compiler import diskcache

KEY = {"kind": "fwd", "config": {"arch": "sm_90a"}, "versions": {"tilelang": "0.1.15"}}
FILES = {"executable.so": b"\x7fELF" + bytes(range(256)) * 4, "params.json": b"[]", "device_kernel.cu": b"// k"}
PLANTED = b"\x7fELF planted by someone else" * 8
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: chown to another uid (another user's files)")


def _unused_uid() -> int:
    uid = 54321
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def _make_entry(root, key=KEY, files=FILES):
    root = diskcache.ensure_cache_dir(root)
    name = diskcache.entry_name(key["kind"], key)

    def write(d):
        for n, blob in files.items():
            (d / n).write_bytes(blob)

    with diskcache.key_lock(root, name):
        entry = diskcache.store(root, name, key, write, kind=key["kind"], summary="fwd sm_90a-test")
    return root, name, entry


def _edit_manifest(entry, change):
    """Edit the manifest's fields (sealed again where this flashsink seals: what only someone who can
    write as you could do, so that the schema is what catches it)."""
    p = entry / diskcache.ENTRY_MANIFEST
    m = json.loads(p.read_text())
    change(m)
    seal = getattr(diskcache, "_seal", None)
    p.write_text(seal(m) if seal else json.dumps(m))


def _in_child(fn, *, timeout=30.0, uid=None):
    """``fn()`` in a forked child (as ``uid`` if given); returns its result. A child still running after
    ``timeout`` seconds is killed and the test fails: it hung."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        code = 1
        try:
            os.close(r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            out = ("ok", fn())
            code = 0
        except BaseException as exc:  # reported to the test
            out = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        finally:
            try:
                os.write(w, pickle.dumps(out))
            finally:
                os._exit(code)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"hung: still running after {timeout:.0f} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    assert status == "ok", value
    return value


@pytest.fixture
def shared_tmp():
    """A directory in /tmp that another uid can reach (pytest's tmp_path is private to root)."""
    d = tempfile.mkdtemp(prefix="fs-trust-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _chown_tree(path, uid):
    os.lchown(path, uid, uid)
    for top, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(top, n), uid, uid)


def _planted_cache(path, uid=None):
    """A cache holding a valid entry for KEY whose library is PLANTED (owned by ``uid`` if given)."""
    root, name, entry = _make_entry(path, files={**FILES, "executable.so": PLANTED})
    if uid is not None:
        _chown_tree(root, uid)
    return root


# ----------------------------------------------------------------------------------------------
# 1. the directory is checked again before every load, not remembered once

@pytest.mark.boundary
def test_item1_chmod_777_after_first_load_is_refused(tmp_path):
    given = tmp_path / "cache"
    root, name, _ = _make_entry(given)
    assert diskcache.load(root, name, KEY)[1] == FILES
    os.chmod(root, 0o777)
    with pytest.raises(CacheDirError, match=r"writable by group or others \(mode 0777\)"):
        diskcache.load(root, name, KEY)
    with pytest.raises(CacheDirError, match="writable by group or others"):
        diskcache.ensure_cache_dir(given)
    os.chmod(root, 0o700)  # fixed: accepted again (the walk repeats, nothing stays refused or trusted)
    assert diskcache.load(diskcache.ensure_cache_dir(given), name, KEY)[1] == FILES


@pytest.mark.boundary
@pytest.mark.parametrize("other_user", [False, pytest.param(True, marks=needs_root)], ids=["open-dir", "other-uid"])
def test_item1_repointed_symlink_is_walked_again(tmp_path, other_user):
    """FLASHSINK_CACHE_DIR a private symlink; after a load it is re-pointed to a directory holding a
    planted entry (group/other-writable, or owned by another uid): refused, the planted library never read."""
    mine = _make_entry(tmp_path / "mine")[0]
    link = tmp_path / "link"
    link.symlink_to(mine)
    root = diskcache.ensure_cache_dir(link)
    name = diskcache.entry_name("fwd", KEY)
    assert diskcache.load(root, name, KEY)[1] == FILES
    theirs = _planted_cache(tmp_path / "theirs", _unused_uid() if other_user else None)
    if not other_user:
        os.chmod(theirs, 0o777)
    tmp_link = tmp_path / "link.new"
    tmp_link.symlink_to(theirs)
    os.replace(tmp_link, link)
    with pytest.raises(CacheDirError, match="owned by uid|writable by group or others"):
        loaded = diskcache.load(diskcache.ensure_cache_dir(link), name, KEY)
        assert loaded is None or loaded[1]["executable.so"] != PLANTED, "the planted library was loaded"


@needs_root
@pytest.mark.boundary
def test_item1_walk_refuses_a_symlink_owned_by_someone_else(tmp_path):
    mine = diskcache.ensure_cache_dir(tmp_path / "mine")
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, _unused_uid(), _unused_uid())
    with pytest.raises(CacheDirError, match="symlink owned by uid"):
        diskcache.ensure_cache_dir(link)


# ----------------------------------------------------------------------------------------------
# 2. the directories above the cache are checked

@pytest.mark.boundary
def test_item2_world_writable_non_sticky_parent_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(CacheDirError, match=r"above it is writable by group or others and not sticky \(mode 0777\)"):
        diskcache.ensure_cache_dir(parent / "cache")
    assert not (parent / "cache").exists(), "nothing is created under an unsafe parent"
    os.chmod(parent, 0o1777)  # sticky, like /tmp: others cannot rename what is ours
    assert diskcache.ensure_cache_dir(parent / "cache") == parent / "cache"


@needs_root
@pytest.mark.boundary
def test_item2_parent_owned_by_someone_else_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    diskcache.ensure_cache_dir(parent / "cache")
    os.chown(parent, _unused_uid(), _unused_uid())
    with pytest.raises(CacheDirError, match="above it is owned by uid"):
        diskcache.ensure_cache_dir(parent / "cache")


# ----------------------------------------------------------------------------------------------
# 3. no symlinked subdirectory (lstat, not stat)

@pytest.mark.boundary
@pytest.mark.parametrize("sub", diskcache.SUBDIRS)
def test_item3_symlinked_subdirectory_is_refused(tmp_path, sub):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)  # ours and private: still refused, links are never followed
    shutil.rmtree(root / sub)
    (root / sub).symlink_to(elsewhere)
    with pytest.raises(CacheDirError, match=f"{sub}: is a symlink"):
        diskcache.ensure_cache_dir(tmp_path / "cache")
    assert main(["cache", "info", "--dir", str(root)]) == 2


@pytest.mark.boundary
def test_item3_symlinked_entry_is_not_followed(tmp_path, caplog):
    """An entry that is a symlink to a valid entry elsewhere is not loaded (and its target not touched)."""
    root, name, entry = _make_entry(tmp_path / "cache")
    other = _make_entry(tmp_path / "other")[2]
    shutil.rmtree(entry)
    entry.symlink_to(other)
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert diskcache.load(root, name, KEY) is None
    assert "symlink" in caplog.text
    assert sorted(os.listdir(other)) == sorted([*FILES, diskcache.ENTRY_MANIFEST]), "the link's target was touched"


# ----------------------------------------------------------------------------------------------
# 4. cache clear removes only what flashsink wrote

@pytest.mark.l0
def test_item4_clear_leaves_foreign_files_alone(tmp_path, capsys):
    root, name, entry = _make_entry(tmp_path / "cache")
    foreign = {
        root / "kernels" / "notes.txt": b"mine",
        root / "kernels" / "my-folder" / "data.bin": b"\x01\x02",
        root / "tmp" / "foreign.txt": b"mine too",
        root / "locks" / "other.lock": b"",
        root / "locks" / "readme": b"not a lock",
    }
    for p, blob in foreign.items():
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(blob)
    assert main(["cache", "clear", "--yes", "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entries" in out and not entry.exists()
    for p, blob in foreign.items():
        assert p.read_bytes() == blob, f"{p} was deleted or changed"
        assert str(p.relative_to(root).parts[0]) in out
    assert "left alone" in out and "notes.txt" in out and "foreign.txt" in out and "other.lock" in out
    assert sorted(os.listdir(root / "locks")) == ["other.lock", "readme"], "flashsink's own lock is removed"


@pytest.mark.l0
def test_item4_clear_refuses_a_symlinked_kernels_dir(tmp_path, capsys):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "a.txt").write_text("a")
    (victim / "b.txt").write_text("b")
    shutil.rmtree(root / "kernels")
    (root / "kernels").symlink_to(victim)
    assert main(["cache", "clear", "--yes", "--dir", str(root)]) == 2
    assert "symlink" in capsys.readouterr().err
    assert sorted(os.listdir(victim)) == ["a.txt", "b.txt"]


@pytest.mark.boundary
def test_item4_entry_with_a_foreign_file_keeps_that_file(tmp_path, capsys):
    """clear deletes an entry's files named by its manifest; a file added to the entry stays (listed)."""
    root, name, entry = _make_entry(tmp_path / "cache")
    (entry / "my-notes.txt").write_text("keep me")
    assert main(["cache", "clear", "--yes", "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(entry)) == ["my-notes.txt"] and "my-notes.txt" in out


# ----------------------------------------------------------------------------------------------
# 5. the stale-tmp sweep of store() removes only flashsink's own, dead, old directories

def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # no process can have it


@pytest.mark.l0
def test_item5_store_keeps_foreign_tmp_items(tmp_path):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    dead = _dead_pid()
    file, folder = root / "tmp" / "foreign.txt", root / "tmp" / f"build-{dead}-mine"
    file.write_text("mine")
    folder.mkdir()
    (folder / "data").write_text("mine too")
    old = time.time() - 3600
    for p in (file, folder):
        os.utime(p, (old, old))
    _make_entry(root)  # store() sweeps tmp/
    assert file.read_text() == "mine" and (folder / "data").read_text() == "mine too"


@pytest.mark.l0
def test_item5_sweep_removes_flashsink_dirs_of_dead_processes(tmp_path):
    root = diskcache.ensure_cache_dir(tmp_path / "cache")
    stale = diskcache._marked_dir(root, "build")
    (stale / "nvcc-leftover.cu").write_text("//")
    marker = json.loads((stale / diskcache.TMP_MARKER).read_text())
    marker["pid"] = _dead_pid()
    (stale / diskcache.TMP_MARKER).write_text(diskcache._seal(marker))
    live = diskcache._marked_dir(root, "build")  # this process's: kept however old
    old = time.time() - 3600
    for p in (stale, live):
        os.utime(p, (old, old))
    _make_entry(root)
    assert not stale.exists() and live.exists()
    shutil.rmtree(live)


# ----------------------------------------------------------------------------------------------
# 6. a FIFO in an entry neither hangs `cache info` nor a load (which holds the key's lock)

@pytest.mark.boundary
@pytest.mark.parametrize("which", [diskcache.ENTRY_MANIFEST, "params.json"])
def test_item6_fifo_in_an_entry_does_not_hang(tmp_path, which):
    root, name, entry = _make_entry(tmp_path / "cache")
    (entry / which).unlink()
    os.mkfifo(entry / which, 0o600)

    def read_it():
        if which != diskcache.ENTRY_MANIFEST:  # swapped in after a check by name (is_file), before the
            real = pathlib.Path.is_file        # open: only a check of what was opened (fstat) sees it
            pathlib.Path.is_file = lambda p: p == entry / which or real(p)  # (in the forked child only)
        infos = diskcache.entries(root)
        with diskcache.key_lock(root, name):
            hit = diskcache.load(root, name, KEY)
        return [i.status for i in infos], hit

    statuses, hit = _in_child(read_it, timeout=30)
    assert hit is None and len(statuses) == 1 and "not a regular file" in statuses[0]


# ----------------------------------------------------------------------------------------------
# 7. a file that cannot be read is a bad entry, not a PermissionError traceback

@pytest.mark.boundary
def test_item7_unreadable_entry_file_is_a_bad_entry(shared_tmp):
    root, name, entry = _make_entry(os.path.join(shared_tmp, "cache"))
    os.chmod(entry / "params.json", 0)

    def read_it():
        infos = diskcache.entries(root)
        hit = diskcache.load(root, name, KEY)
        return [i.status for i in infos], hit

    if IS_ROOT:  # root reads a mode-000 file: the reader must be another user, owning the cache
        uid = _unused_uid()
        _chown_tree(shared_tmp, uid)
        statuses, hit = _in_child(read_it, uid=uid)
    else:
        statuses, hit = read_it()
    assert hit is None and "params.json cannot be read" in statuses[0], statuses


# ----------------------------------------------------------------------------------------------
# 8. a manifest of valid JSON but wrong types is a bad entry

WRONG_TYPES = {
    "files-int-record": (lambda m: m.update(files=dict.fromkeys(m["files"], 1)), "is not {'size': int"),
    "kind-int": (lambda m: m.update(kind=7), "'kind' is int"),
    "files-list": (lambda m: m.update(files=[]), "'files' is list"),
    "key-list": (lambda m: m.update(key=[1]), "'key' is list"),
    "sha256-int": (lambda m: m["files"]["params.json"].update(sha256=5), "record of 'params.json'"),
    "size-bool": (lambda m: m["files"]["params.json"].update(size=True), "record of 'params.json'"),
    "name-traversal": (lambda m: m["files"].update({"../x": m["files"]["params.json"]}), "bad file name"),
}


@pytest.mark.boundary
@pytest.mark.parametrize("how", list(WRONG_TYPES))
def test_item8_manifest_with_wrong_types_is_rebuilt(tmp_path, caplog, capsys, how):
    root, name, entry = _make_entry(tmp_path / "cache")
    change, reason = WRONG_TYPES[how]
    _edit_manifest(entry, change)
    assert main(["cache", "info", "--dir", str(root)]) == 0
    assert "CORRUPT" in capsys.readouterr().out
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert diskcache.load(root, name, KEY) is None
    assert "failed verification" in caplog.text and reason in caplog.text
    assert not entry.exists()


# ----------------------------------------------------------------------------------------------
# 9. the manifest's own fields are checksummed

@pytest.mark.boundary
def test_item9_edited_summary_is_detected(tmp_path, caplog, capsys):
    root, name, entry = _make_entry(tmp_path / "cache")
    p = entry / diskcache.ENTRY_MANIFEST
    m = json.loads(p.read_text())
    m["summary"] = "fwd EDITED-BY-SOMEONE"
    p.write_text(json.dumps(m, indent=1, sort_keys=True))
    assert main(["cache", "info", "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "EDITED-BY-SOMEONE" not in out
    caplog.set_level(logging.WARNING, logger="flashsink")
    assert diskcache.load(root, name, KEY) is None
    assert "checksum does not match" in caplog.text


@pytest.mark.l0
def test_manifest_is_sealed_and_bad_entry_is_moved_not_deleted_blindly(tmp_path):
    """A bad entry without a valid manifest is moved out of kernels/ (so it is rebuilt) but its files,
    which flashsink cannot tell are its own, are not deleted; `clear` lists them."""
    root, name, entry = _make_entry(tmp_path / "cache")
    m = json.loads((entry / diskcache.ENTRY_MANIFEST).read_text())
    assert m["format"] == diskcache.FORMAT and len(m["checksum"]) == 64
    (entry / diskcache.ENTRY_MANIFEST).write_text("{not json")
    assert diskcache.load(root, name, KEY) is None and not entry.exists()
    moved = [p for p in (root / "tmp").iterdir() if p.name.startswith("discard-")]
    assert len(moved) == 1 and (moved[0] / "executable.so").read_bytes() == FILES["executable.so"]
    done = diskcache.clear(root)
    assert [p for p, _ in done.kept] == moved and moved[0].exists()
    assert stat.S_IMODE(os.lstat(moved[0]).st_mode) == 0o700
