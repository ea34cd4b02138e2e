"""The on-disk kernel cache: a private directory of verified entries (docs/caching.md, "Security model").

``$FLASHSINK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flashsink``, else ``~/.cache/flashsink``) holds
``kernels/<kind>-<digest>/`` (TileLang's files and ENTRY_MANIFEST), ``locks/<kind>-<digest>.lock`` (one
compile per key across processes) and ``tmp/``. An entry holds a shared library that is loaded into the
process, so its sealed manifest records the full key and every file's sha256; it is loaded only from
the bytes that were hashed, published with one rename, and moved away and rebuilt if it fails. Only
what a valid flashsink marker names is ever deleted. The directory's trust checks are ``cachedir``'s.
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
from . import cachedir
from .cachedir import ENV_DIR, SUBDIRS, read_regular

log = logging.getLogger("flashsink")

#: 2: the manifest is sealed (a checksum over its own fields); 1's entries are rebuilt
FORMAT = 2
ENTRY_MANIFEST = "flashsink-entry.json"
#: the marker file of a directory flashsink made in tmp/
TMP_MARKER = "flashsink-tmp.json"
#: the first line of every lock file flashsink made (``clear`` removes only those)
LOCK_MARKER = b"flashsink kernel-cache lock\n"
#: a tmp/ directory whose process is gone and that is older than this is removed
STALE_TMP_SECONDS = 600
_MANIFEST_LIMIT = 1 << 20  # a manifest is a few KiB; a bigger file is not one of ours


def cache_dir() -> Path:
    """The cache directory this process uses: ``FLASHSINK_CACHE_DIR``, else the XDG default."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(os.path.expanduser(given)).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(base) / "flashsink").absolute()


def ensure_cache_dir(path: Path | None = None) -> Path:
    """The resolved cache directory, created (mode 0700) and checked (``cachedir.trusted_root``)."""
    return cachedir.trusted_root(path if path is not None else cache_dir())


def canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def digest(key: dict) -> str:
    return hashlib.sha256(canonical(key).encode()).hexdigest()


def entry_name(kind: str, key: dict) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in kind) or "kernel"
    return f"{safe}-{digest(key)[:32]}"


def _open_lock(path: Path) -> int:
    """The lock file's fd: a regular file of ours, never a link (O_NOFOLLOW) or a FIFO (O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CacheDirError(f"flashsink cannot open its lock file {path}: {exc}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise CacheDirError(f"flashsink lock file {path} is not a regular file of yours; remove it")
    return fd


@contextlib.contextmanager
def key_lock(root: Path, name: str):
    """Hold the per-key lock: one compile per key across processes and threads."""
    fd = _open_lock(root / "locks" / f"{name}.lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("flashsink: another process is compiling %s; waiting for it", name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_size == 0:  # new: mark it as ours (under the lock: written once)
            os.write(fd, LOCK_MARKER)
        yield
    finally:
        os.close(fd)  # closing releases the flock


# ----------------------------------------------------------------------------------------------
# manifests and markers: sealed JSON (a checksum over the other fields), checked against a schema

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _seal(record: dict) -> str:
    """``record`` as JSON with ``checksum``: the sha256 of its other fields, canonical."""
    plain = json.loads(canonical(record))  # what reading it back gives (tuples are lists, ...)
    plain.pop("checksum", None)
    return json.dumps({**plain, "checksum": _sha256(canonical(plain).encode())}, indent=1, sort_keys=True)


def _types_of(record: dict, schema: dict) -> str | None:
    """What is wrong with the types of ``record``'s fields (``schema``: field -> type), or None."""
    for name, want in schema.items():
        if name not in record:
            return f"field {name!r} missing"
        value = record[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            return f"field {name!r} is {type(value).__name__}, not {getattr(want, '__name__', want)}"
    return None


#: how deep a manifest's or marker's JSON may nest (ours: 4): refusing deeper keeps every later step
#: (the checksum's json.dumps, the key's digest) clear of RecursionError
_MAX_DEPTH = 32


def _too_deep(value) -> bool:
    todo = [(value, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            if depth > _MAX_DEPTH:
                return True
            todo += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return False


def _unseal(blob: bytes, schema: dict) -> dict:
    """The record in ``blob``: JSON of the current format, the schema's types, its checksum matching.
    ValueError saying what is wrong, never another exception: the bytes are whatever was on disk."""
    try:
        record = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("not a record of ours (JSON nested too deep)") from None
    if _too_deep(record):
        raise ValueError(f"not a record of ours (JSON nested deeper than {_MAX_DEPTH})")
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    if record.get("format") != FORMAT:
        raise ValueError(f"unknown format {record.get('format')!r} (this flashsink writes {FORMAT})")
    wrong = _types_of(record, {**schema, "checksum": str})
    if wrong:
        raise ValueError(wrong)
    plain = {k: v for k, v in record.items() if k != "checksum"}
    if record["checksum"] != _sha256(canonical(plain).encode()):
        raise ValueError("its checksum does not match its fields (edited)")
    return record


_MANIFEST_SCHEMA = {"format": int, "name": str, "kind": str, "summary": str, "key": dict, "files": dict,
                    "created": str}


def _plain_name(name: str) -> bool:
    """Whether ``name`` can be a file of an entry: one path component the file system can hold."""
    if not name or "/" in name or "\0" in name or name in (".", "..", ENTRY_MANIFEST, TMP_MARKER):
        return False
    try:
        return len(os.fsencode(name)) <= 255
    except UnicodeEncodeError:  # a lone surrogate the file system's encoding cannot write
        return False


def _check_files(files: dict) -> None:
    if not files:
        raise ValueError("manifest lists no files")
    for name, meta in files.items():
        if not _plain_name(name):
            raise ValueError(f"manifest lists a bad file name {name[:80]!r}")
        if (not isinstance(meta, dict) or _types_of(meta, {"size": int, "sha256": str}) or meta["size"] < 0
                or len(meta["sha256"]) != 64 or not set(meta["sha256"]) <= set("0123456789abcdef")):
            raise ValueError(f"manifest's record of {name!r} is not {{'size': int >= 0, 'sha256': hex digest}}: "
                             f"{meta!r:.200}")


def parse_manifest(blob: bytes, name: str) -> dict:
    """The manifest of entry ``name`` from its bytes, fully validated; raises ValueError."""
    manifest = _unseal(blob, _MANIFEST_SCHEMA)
    _check_files(manifest["files"])
    if manifest["name"] != name or entry_name(manifest["kind"], manifest["key"]) != name:
        raise ValueError("entry name does not match its recorded key")
    return manifest


# ----------------------------------------------------------------------------------------------
# entries

def _verify_fd(fd: int, name: str, key: dict | None) -> tuple[dict, dict]:
    try:
        manifest = parse_manifest(read_regular(ENTRY_MANIFEST, fd, _MANIFEST_LIMIT), name)
    except ValueError as exc:
        raise ValueError(f"manifest unreadable: {exc}") from None
    if key is not None and canonical(manifest["key"]) != canonical(key):
        raise ValueError("recorded key differs from the key asked for")
    files = manifest["files"]
    present = set(os.listdir(fd)) - {ENTRY_MANIFEST}
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        raise ValueError(f"files differ from the manifest (missing {missing}, unexpected {extra})")
    data = {}
    for file, meta in files.items():
        blob = read_regular(file, fd, meta["size"])  # never more than the manifest says it holds
        if _sha256(blob) != meta["sha256"]:
            raise ValueError(f"sha256 of {file} differs from the recorded one")
        data[file] = blob
    return manifest, data


def verify_entry(entry: Path, key: dict | None = None) -> tuple[dict, dict]:
    """(manifest, {file name: verified bytes}) of one entry, or ValueError saying what is wrong.
    ``key=None`` checks the files against the manifest only (``cache info``)."""
    try:
        fd = cachedir.open_entry(entry)
    except (OSError, CacheDirError) as exc:
        raise ValueError(f"not a private directory of yours: {exc}") from None
    try:
        return _verify_fd(fd, entry.name, key)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc}") from None
    finally:
        os.close(fd)


def _sealed(path: Path, file: str, parse) -> dict | None:
    """``parse(bytes)`` of ``file`` in the directory ``path`` (private and ours, never a link followed),
    or None if any of that fails."""
    try:
        fd = cachedir.open_entry(path)
    except (OSError, CacheDirError):
        return None
    try:
        return parse(read_regular(file, fd, _MANIFEST_LIMIT))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _valid_manifest(path: Path, name: str | None = None) -> dict | None:
    """The valid manifest of entry ``name`` (default: the directory's name) in ``path``, or None."""
    return _sealed(path, ENTRY_MANIFEST, lambda blob: parse_manifest(blob, name or path.name))


def _marked_files(path: Path, name: str) -> list | None:
    """The files a valid manifest of entry ``name`` in ``path`` names, the manifest last; None without one."""
    manifest = _valid_manifest(path, name)
    return None if manifest is None else [*sorted(manifest["files"]), ENTRY_MANIFEST]


def _remove_marked(path: Path, files: list) -> list:
    """Remove the regular files ``files`` of ``path``, then ``path`` if that emptied it; returns what is
    left (a link or a directory named in ``files`` stays)."""
    for f in files:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(path / f).st_mode):
                os.unlink(path / f)
    try:
        os.rmdir(path)
        return []
    except OSError:
        with contextlib.suppress(OSError):
            return sorted(os.listdir(path))
        return []


def discard(root: Path, path: Path) -> None:
    """Take the entry ``path`` out of ``kernels/`` (one rename into ``tmp/``), then delete the files its
    manifest names; what flashsink did not write stays in ``tmp/discard-*`` (``clear`` lists it)."""
    files = _marked_files(path, path.name)
    trash = root / "tmp" / f"discard-{os.getpid()}-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    if files is not None:
        left = _remove_marked(trash, files)
        if left:
            log.warning("flashsink: cache entry %s held files flashsink did not write (%s); left them in %s",
                        path, ", ".join(left), trash)
    else:
        try:
            os.rmdir(trash)  # an empty directory (never a link or a file: rmdir refuses those)
        except OSError:
            log.warning("flashsink: cache entry %s had no valid manifest; moved it, undeleted, to %s", path, trash)


def load(root: Path, name: str, key: dict) -> tuple[dict, dict] | None:
    """The verified (manifest, files) of entry ``name`` for ``key``, or None on a miss; with the key's
    lock held. The directory is checked again first (``cachedir.recheck``: :class:`CacheDirError`); an
    entry that fails verification is a miss, logged and moved away, so the caller rebuilds it."""
    cachedir.recheck(root)
    entry = root / "kernels" / name
    if not os.path.lexists(entry):
        return None
    try:
        return verify_entry(entry, key)
    except ValueError as why:
        log.warning("flashsink: cache entry %s failed verification (%s); not loading it, rebuilding it", entry, why)
        discard(root, entry)
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# tmp/: directories with flashsink's marker, removed only once their process is gone

_TMP_SCHEMA = {"format": int, "name": str, "pid": int, "host": str}


def _tmp_marker(path: Path) -> dict | None:
    """The valid marker of the tmp/ directory ``path``, or None."""
    marker = _sealed(path, TMP_MARKER, lambda blob: _unseal(blob, _TMP_SCHEMA))
    if marker is None or marker["name"] != path.name or not 0 < marker["pid"] < 1 << 31:
        return None  # a pid os.kill cannot take (0, -1, huge) was no process of ours
    return marker


def _alive(marker: dict) -> bool:
    """Whether the process that made a tmp/ directory may still run (another host's: assumed so)."""
    if marker["host"] != os.uname().nodename:
        return True
    try:
        os.kill(marker["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def sweepable(path: Path, older_than: float | None = None) -> bool:
    """Whether tmp/``path`` is flashsink's, its process gone and (``older_than``) untouched that long."""
    marker = _tmp_marker(path)
    if marker is None or _alive(marker):
        return False
    if older_than is None:
        return True
    try:
        return time.time() - os.lstat(path).st_mtime > older_than
    except OSError:
        return False


def _rmtree(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)  # the fd-based rmtree: links inside are removed, never followed


def _listed(path: Path) -> list:
    """The items of the cache subdirectory ``path``, sorted; none if it is missing."""
    try:
        return sorted(path.iterdir())
    except FileNotFoundError:
        return []


def _clean_stale_tmp(root: Path) -> None:
    """Remove flashsink's tmp/ directories whose process is gone and that were not touched for a while."""
    for p in _listed(root / "tmp"):
        if sweepable(p, STALE_TMP_SECONDS):
            _rmtree(p)


def _marked_dir(root: Path, prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=root / "tmp"))
    marker = {"format": FORMAT, "name": d.name, "pid": os.getpid(), "host": os.uname().nodename}
    (d / TMP_MARKER).write_text(_seal(marker))
    return d


@contextlib.contextmanager
def scratch(root: Path, prefix: str):
    """A fresh directory ``tmp/<prefix>-<pid>-*`` with flashsink's marker, removed afterwards."""
    d = _marked_dir(root, prefix)
    try:
        yield d
    finally:
        _rmtree(d)


def store(root: Path, name: str, key: dict, write_files, *, kind: str, summary: str, extra: dict | None = None) -> Path:
    """Publish a new entry, with the key's lock held: ``write_files(staging_dir)`` writes the kernel's
    files, their checksums and the key go into the manifest, and one rename puts it in place."""
    _clean_stale_tmp(root)
    with scratch(root, f"stage-{name}") as staging:
        write_files(staging)
        files = {}
        for p in sorted(staging.iterdir()):
            if p.name == TMP_MARKER:
                continue
            if not p.is_file() or p.is_symlink():
                raise RuntimeError(f"unexpected non-file {p.name} in a cache entry")
            with open(p, "rb") as f:
                blob = f.read()
            files[p.name] = {"size": len(blob), "sha256": _sha256(blob)}
            _fsync(p)
        manifest = {
            **(extra or {}), "format": FORMAT, "name": name, "kind": kind, "summary": summary, "key": key,
            "files": files, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(staging / ENTRY_MANIFEST, "w") as f:
            f.write(_seal(manifest))
            f.flush()
            os.fsync(f.fileno())
        os.unlink(staging / TMP_MARKER)  # an entry now, unmarked until the rename
        os.chmod(staging, 0o700)
        _fsync(staging)
        final = root / "kernels" / name
        if os.path.lexists(final):  # a stale or broken entry: take it out of view first
            discard(root, final)
        try:
            os.rename(staging, final)
        except OSError:
            if not os.path.lexists(final):
                raise
            # a writer that did not hold our lock published first: keep theirs
        _fsync(root / "kernels")
        return final


@contextlib.contextmanager
def private_tmp(root: Path):
    """A build directory in ``tmp/`` that is the process's temporary directory (``tempfile`` and
    ``TMPDIR``, which nvcc uses) while the block runs, removed afterwards: a failed compile leaves no
    files. Process-wide, so for flashsink's compile processes only (compile.py's docstring)."""
    old_tempdir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    with scratch(root, "build") as build:
        tempfile.tempdir = str(build)
        os.environ["TMPDIR"] = str(build)
        try:
            yield build
        finally:
            tempfile.tempdir = old_tempdir
            if old_env is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old_env


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


def _entry_size(path: Path) -> int:
    """Bytes of the regular files in the entry directory ``path`` (flat; no link followed); 0 if ``path``
    is not a directory itself."""
    try:
        fd = cachedir.open_dir(path)
    except OSError:
        return 0
    total = 0
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    except OSError:
        pass
    finally:
        os.close(fd)
    return total


def entries(root: Path) -> list:
    """Every entry under ``root/kernels``, each verified against its own manifest."""
    out = []
    for entry in _listed(root / "kernels"):
        info = EntryInfo(name=entry.name, size=_entry_size(entry))
        try:
            manifest, _ = verify_entry(entry)
        except ValueError as why:
            info.status = f"CORRUPT: {why}"
            manifest = _valid_manifest(entry)  # shown only if the manifest itself is intact
        if manifest is not None:
            info.kind, info.summary, info.created = manifest["kind"], manifest["summary"], manifest["created"]
            versions = manifest["key"].get("versions")
            info.versions = versions if isinstance(versions, dict) else {}
        out.append(info)
    return out


@dataclass
class Cleared:
    entries: int = 0
    bytes: int = 0
    kept: list = field(default_factory=list)  # (path, why) of what was left alone


def _clear_lock(p: Path, kept: list) -> None:
    try:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        kept.append((p, f"not a lock file of flashsink's ({exc.strerror or exc})"))
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or os.pread(fd, 64, 0) != LOCK_MARKER:
            kept.append((p, "no flashsink lock marker"))
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not held by a compile now
        except BlockingIOError:
            return  # in use: not "left alone", just busy
        os.unlink(p)
    except OSError as exc:
        kept.append((p, f"could not be removed ({exc.strerror or exc})"))
    finally:
        os.close(fd)


def clear(root: Path) -> Cleared:
    """Remove every entry, leftover tmp/ directory and unused lock that a valid flashsink marker names;
    the rest stays, listed in ``Cleared.kept``. ``root`` must have passed ``cachedir.trusted_root``."""
    cachedir.recheck(root)
    done = Cleared()
    for entry in _listed(root / "kernels"):
        files = _marked_files(entry, entry.name)
        if files is None:
            done.kept.append((entry, "no valid flashsink manifest (or not a directory of yours)"))
            continue
        size = _entry_size(entry)
        left = _remove_marked(entry, files)
        if left:
            done.kept.append((entry, f"holds files flashsink did not write: {', '.join(left)}"))
        else:
            done.entries += 1
            done.bytes += size
    for p in _listed(root / "tmp"):
        if sweepable(p):
            _rmtree(p)
        elif _tmp_marker(p) is None:
            done.kept.append((p, "no flashsink marker"))
        # else: a compile or save in progress uses it, and removes it itself
    for p in _listed(root / "locks"):
        _clear_lock(p, done.kept)
    return done
