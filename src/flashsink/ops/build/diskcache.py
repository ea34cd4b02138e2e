"""The on-disk kernel cache: a private directory of verified entries.

Layout of ``$FLASHSINK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashsink``, else
``~/.cache/flashsink``)::

    kernels/<kind>-<digest>/   one compiled kernel: TileLang's files plus ENTRY_MANIFEST
    locks/<kind>-<digest>.lock one flock per key: who compiles, who waits
    tmp/                       staging and build directories, renamed or removed when done

Security model. An entry holds a shared library that is loaded into the process, so:

* the cache directory and its subdirectories are created with mode 0700, and a directory that is
  owned by another user or writable by group/others is refused with :class:`CacheDirError`
  (another user could otherwise plant code there);
* every entry records its full key and the sha256 of each of its files; before loading, the key
  must equal the one asked for and every file must hash to its recorded value, with no file
  missing or added. The bytes that were hashed are the bytes that get loaded (they are copied to a
  private temporary file first), so nothing can swap a file between the check and the load. An
  entry that fails is logged as a warning, removed and rebuilt, never loaded.

What this does not defend against: someone who can already write files as you (they could edit
the manifest along with the library, or your shell profile). The checksums catch corruption,
half-written files and edits to single files; the permissions keep other users out.

Concurrency: entries are built in ``tmp/`` and published with one atomic ``os.rename``, so a
reader sees a complete entry or none. A per-key ``fcntl.flock`` makes processes that need the same
kernel at once compile it once: the first compiles, the others wait, then load its entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CacheDirError

log = logging.getLogger("flashsink")

ENV_DIR = "FLASHSINK_CACHE_DIR"
FORMAT = 1
ENTRY_MANIFEST = "flashsink-entry.json"
SUBDIRS = ("kernels", "locks", "tmp")
#: a staging/build directory whose process is gone and that is older than this is removed
STALE_TMP_SECONDS = 600


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashsink"


def cache_dir() -> Path:
    """The cache directory this process uses (``FLASHSINK_CACHE_DIR`` or the default)."""
    given = os.environ.get(ENV_DIR)
    return Path(os.path.expanduser(given)).absolute() if given else default_cache_dir().absolute()


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private_dir(path: Path) -> None:
    """Raise :class:`CacheDirError` unless ``path`` is a directory owned by us that only we can write."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CacheDirError(f"flashsink cache directory {path} cannot be read: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"flashsink cache directory {path} is not a directory; set {ENV_DIR} to a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise CacheDirError(
            f"flashsink cache directory {path} is owned by {_owner_name(st.st_uid)}, not by you "
            f"({_owner_name(me)}). It holds native code that is loaded into this process, so flashsink only "
            f"uses a directory of your own: set {ENV_DIR} to one (it is created with mode 0700)."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"flashsink cache directory {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}). It holds native code that is loaded into this process, so "
            f"flashsink refuses it: run `chmod go-w {path}` (or `chmod 700`), or set {ENV_DIR} to a private directory."
        )


_checked: set = set()


def ensure_cache_dir(path: Path | None = None) -> Path:
    """Create (mode 0700) and check the cache directory and its subdirectories; returns it."""
    root = Path(path) if path is not None else cache_dir()
    if root in _checked and root.is_dir():
        return root
    for d in (root, *(root / s for s in SUBDIRS)):
        try:
            d.mkdir(mode=0o700, parents=True)
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask; ours must not be looser
        except FileExistsError:
            pass
        except OSError as exc:
            raise CacheDirError(
                f"flashsink cannot create its cache directory {d}: {exc}. Set {ENV_DIR} to a writable "
                "directory of your own."
            ) from exc
        check_private_dir(d)
    _checked.add(root)
    return root


# ----------------------------------------------------------------------------------------------
# keys

def canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def digest(key: dict) -> str:
    return hashlib.sha256(canonical(key).encode()).hexdigest()


def entry_name(kind: str, key: dict) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in kind) or "kernel"
    return f"{safe}-{digest(key)[:32]}"


@contextlib.contextmanager
def key_lock(root: Path, name: str):
    """Hold the per-key lock. Yields True if it had to wait for another process (or thread)."""
    path = root / "locks" / f"{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        waited = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            log.info("flashsink: another process is compiling %s; waiting for it", name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield waited
    finally:
        os.close(fd)  # closing releases the flock


# ----------------------------------------------------------------------------------------------
# entries

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(entry: Path) -> dict:
    with open(entry / ENTRY_MANIFEST, "rb") as f:
        manifest = json.loads(f.read())
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"unknown manifest format {manifest.get('format') if isinstance(manifest, dict) else '?'}")
    return manifest


def verify_entry(entry: Path, key: dict | None = None) -> tuple[dict, dict]:
    """Check one entry; returns (manifest, {file name: verified bytes}). Raises ValueError saying
    what is wrong. ``key=None`` checks the files against the manifest only (``cache info``)."""
    try:
        manifest = _read_manifest(entry)
    except (OSError, ValueError) as exc:
        raise ValueError(f"manifest unreadable: {exc}") from None
    if key is not None:
        if canonical(manifest.get("key")) != canonical(key):
            raise ValueError("recorded key differs from the key asked for")
    if manifest.get("name") != entry.name or entry_name(manifest.get("kind", ""), manifest.get("key")) != entry.name:
        raise ValueError("entry name does not match its recorded key")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError("manifest lists no files")
    present = set(os.listdir(entry)) - {ENTRY_MANIFEST}
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        raise ValueError(f"files differ from the manifest (missing {missing}, unexpected {extra})")
    data = {}
    for name, meta in files.items():
        p = entry / name
        if p.is_symlink() or not p.is_file():
            raise ValueError(f"{name} is not a regular file")
        with open(p, "rb") as f:
            blob = f.read()
        if _sha256(blob) != meta.get("sha256"):
            raise ValueError(f"sha256 of {name} differs from the recorded one")
        data[name] = blob
    return manifest, data


def discard(root: Path, path: Path) -> None:
    """Remove a directory atomically from view (rename into tmp/), then delete it."""
    trash = root / "tmp" / f"discard-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def load(root: Path, name: str, key: dict) -> tuple[dict, dict] | None:
    """The verified (manifest, files) of entry ``name`` for ``key``, or None on a miss.

    An entry that fails verification is a miss: it is logged as a warning and removed, so the
    caller rebuilds it. Call with the key's lock held."""
    entry = root / "kernels" / name
    if not entry.exists():
        return None
    try:
        return verify_entry(entry, key)
    except ValueError as why:
        log.warning("flashsink: cache entry %s failed verification (%s); not loading it, rebuilding it", entry, why)
        discard(root, entry)
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _clean_stale_tmp(root: Path) -> None:
    """Remove what killed processes left in tmp/ (owner gone and not touched for a while)."""
    now = time.time()
    for p in (root / "tmp").iterdir():
        try:
            if not _owner_alive(p.name) and now - p.lstat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass


def store(root: Path, name: str, key: dict, write_files, *, kind: str, summary: str, extra: dict | None = None) -> Path:
    """Publish a new entry: ``write_files(staging_dir)`` writes the kernel's files, then their
    checksums and the key go into the manifest and the directory is renamed into place. Call with
    the key's lock held. Returns the entry path."""
    _clean_stale_tmp(root)
    staging = Path(tempfile.mkdtemp(prefix=f"stage-{os.getpid()}-{name}-", dir=root / "tmp"))
    try:
        write_files(staging)
        files = {}
        for p in sorted(staging.iterdir()):
            if not p.is_file() or p.is_symlink():
                raise RuntimeError(f"unexpected non-file {p.name} in a cache entry")
            with open(p, "rb") as f:
                blob = f.read()
            files[p.name] = {"size": len(blob), "sha256": _sha256(blob)}
            _fsync(p)
        manifest = {
            "format": FORMAT, "name": name, "kind": kind, "summary": summary, "key": key,
            "files": files, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {}),
        }
        with open(staging / ENTRY_MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o700)
        _fsync(staging)
        final = root / "kernels" / name
        if final.exists():  # a stale or broken entry: take it out of view first
            discard(root, final)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.exists():
                raise
            # another writer (one that did not hold our lock) published first: keep theirs
        _fsync(root / "kernels")
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def private_tmp(root: Path):
    """A build directory in ``tmp/`` that is the process's temporary directory (``tempfile`` and
    ``TMPDIR``, which nvcc uses) while the block runs; removed afterwards, success or failure, so a
    failed or killed compile leaves no files behind. Callers serialise compiles (compile.py's lock)."""
    build = tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=root / "tmp")
    old_tempdir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = build
    os.environ["TMPDIR"] = build
    try:
        yield Path(build)
    finally:
        tempfile.tempdir = old_tempdir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(build, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# `flashsink cache info` / `clear`

@dataclass
class EntryInfo:
    name: str
    kind: str = "?"
    summary: str = "?"
    size: int = 0
    created: str = "?"
    status: str = "ok"  # "ok", or what is wrong
    versions: dict = field(default_factory=dict)


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def entries(root: Path) -> list:
    """Every entry under ``root/kernels``, each verified against its own manifest."""
    out = []
    kernels = root / "kernels"
    if not kernels.is_dir():
        return out
    for entry in sorted(kernels.iterdir()):
        info = EntryInfo(name=entry.name, size=_dir_size(entry))
        try:
            manifest, _ = verify_entry(entry)
        except ValueError as why:
            info.status = f"CORRUPT: {why}"
            with contextlib.suppress(OSError, ValueError):
                manifest = _read_manifest(entry)
                info.kind, info.summary = manifest.get("kind", "?"), manifest.get("summary", "?")
        else:
            info.kind, info.summary = manifest.get("kind", "?"), manifest.get("summary", "?")
            info.created = manifest.get("created", "?")
            info.versions = (manifest.get("key") or {}).get("versions", {})
        out.append(info)
    return out


def _owner_alive(tmp_name: str) -> bool:
    """Whether the process that made tmp/<tmp_name> (``build-<pid>-...``, ``stage-<pid>-...``,
    ``load-<pid>-...``) is still running on this host."""
    parts = tmp_name.split("-")
    if len(parts) < 3 or parts[0] not in ("build", "stage", "load") or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def clear(root: Path) -> tuple[int, int]:
    """Remove every entry, leftover temporary directory and unused lock; returns (entries, bytes).

    Only the cache's own subdirectories are touched, never other files in ``root``."""
    removed, freed = 0, 0
    kernels = root / "kernels"
    if kernels.is_dir():
        for entry in list(kernels.iterdir()):
            freed += _dir_size(entry)
            discard(root, entry)
            removed += 1
    tmp = root / "tmp"
    if tmp.is_dir():
        for p in list(tmp.iterdir()):
            if _owner_alive(p.name):
                continue  # a compile or save in progress uses it, and removes it itself
            with contextlib.suppress(OSError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    locks = root / "locks"
    if locks.is_dir():
        for p in list(locks.iterdir()):
            with contextlib.suppress(OSError):
                fd = os.open(p, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not held by a compile now
                    p.unlink()
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
    return removed, freed
