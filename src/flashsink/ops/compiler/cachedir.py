"""Is this path ours and private: the trust checks of the kernel cache directory (docs/caching.md,
"Security model").

:func:`trusted_root` walks the path from ``/`` with ``lstat``: every directory above the cache owned by
this user or root and not writable by others unless sticky, every symlink owned by them too, the cache
and its subdirectories real directories of this user's only; :func:`recheck` repeats that before every
load. :func:`open_entry` and :func:`read_regular` never follow a link or wait on a FIFO.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ...errors import CacheDirError

ENV_DIR = "FLASHSINK_CACHE_DIR"
SUBDIRS = ("kernels", "locks", "tmp")
_MAX_LINKS = 40  # as the kernel's own path resolution (ELOOP)
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
#: flags for every file read from the cache: no symlink followed, no FIFO waited on
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = READ_FLAGS | os.O_DIRECTORY


def _ident(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_uid, st.st_mode)


def owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path, why: str, fix: str = "") -> CacheDirError:
    return CacheDirError(
        f"flashsink cache directory {path}: {why}. It holds native code that is loaded into this process, "
        f"so flashsink refuses it{': ' + fix if fix else ''}; or set {ENV_DIR} to a private directory of "
        "your own (it is created with mode 0700)."
    )


def check_parent(path: str, st: os.stat_result) -> None:
    """A directory above the cache: owned by us or root, not writable by others unless sticky."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "a component of its path is not a directory")
    if st.st_uid not in (me, 0):
        raise _refuse(path, f"a directory above it is owned by {owner_name(st.st_uid)}, neither you "
                            f"({owner_name(me)}) nor root, who could rename the cache away and put another in its place")
    if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"a directory above it is writable by group or others and not sticky (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}): anyone could rename the cache away and put "
                            "another in its place", f"run `chmod go-w {path}` (or `chmod +t`)")


def check_private(path, st: os.stat_result, what: str = "is") -> None:
    """The cache directory, a subdirectory or an entry: a real directory of ours only we can write."""
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"{what} a symlink (flashsink does not follow links inside its cache)")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, f"{what} not a directory")
    if st.st_uid != me:
        raise _refuse(path, f"{what} owned by {owner_name(st.st_uid)}, not by you ({owner_name(me)})")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise _refuse(path, f"{what} writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                      f"run `chmod go-w {path}` (or `chmod 700`)")


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; ours must not be looser
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheDirError(
            f"flashsink cannot create its cache directory {path}: {exc}. Set {ENV_DIR} to a writable "
            "directory of your own."
        ) from exc


def _lstat(path: str, create: bool):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        if not create:
            return None
        _mkdir(path)
        return os.lstat(path)
    except OSError as exc:
        raise CacheDirError(f"flashsink cache directory {path} cannot be read: {exc}") from exc


@dataclass(frozen=True)
class Walk:
    """A passed walk: the resolved root and the identity of every component looked at."""

    root: Path
    idents: tuple  # ((path, (st_dev, st_ino, st_uid, st_mode)), ...)

    def unchanged(self) -> bool:
        try:
            return all(_ident(os.lstat(p)) == ident for p, ident in self.idents)
        except OSError:
            return False


def walk(given, *, create: bool = True) -> Walk | None:
    """``given`` resolved from ``/``, every component checked (module docstring); what is missing created
    (``create``), else None. Raises :class:`CacheDirError`."""
    me = os.geteuid()
    text = os.path.abspath(os.fspath(given))
    try:
        if b"\0" in os.fsencode(text):
            raise ValueError
    except ValueError:  # a NUL byte, or characters this file system's encoding cannot hold
        raise _refuse(repr(text), "is not a path the file system can hold (a NUL byte or an unencodable "
                                  "character in it)") from None
    todo = [p for p in text.split("/") if p]
    resolved, links, idents = "/", 0, []
    st = os.lstat("/")
    check_parent("/", st)
    idents.append(("/", _ident(st)))
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":  # ``resolved`` has no links in it: its parent is its dirname
            resolved = os.path.dirname(resolved)
            continue
        path = os.path.join(resolved, part)
        st = _lstat(path, create)
        if st is None:
            return None
        idents.append((path, _ident(st)))
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (me, 0):
                raise _refuse(path, f"its path goes through a symlink owned by {owner_name(st.st_uid)}, "
                                    "neither you nor root")
            links += 1
            if links > _MAX_LINKS:
                raise _refuse(given, "too many symlinks on its path")
            target = os.readlink(path)
            if target.startswith("/"):
                resolved = "/"
            todo = [p for p in target.split("/") if p] + todo
            continue
        if todo:
            check_parent(path, st)
        else:
            check_private(path, st)
        resolved = path
    if resolved == "/":
        raise _refuse(given, "is the file system's root")
    for sub in SUBDIRS:
        path = os.path.join(resolved, sub)
        st = _lstat(path, create)
        if st is None:
            continue  # only without ``create`` (``cache info`` of a partial cache)
        check_private(path, st)
        idents.append((path, _ident(st)))
    return Walk(Path(resolved), tuple(idents))


_walks: dict = {}  # the path walked (given or resolved) -> its Walk


def trusted_root(given, *, create: bool = True) -> Path | None:
    """The resolved cache directory for ``given``, created (``create``; else None if missing) and checked:
    a full walk, later calls comparing with it and walking again on any difference. Raises
    :class:`CacheDirError` if it is not safe."""
    if not isinstance(given, (str, os.PathLike)) or not isinstance(os.fspath(given), str):
        raise TypeError(f"path: the cache directory must be a str or os.PathLike path, got "
                        f"{type(given).__name__} {given!r:.80}")
    key = os.path.abspath(os.fspath(given))
    done = _walks.get(key)
    if done is not None and done.unchanged():
        return done.root
    _walks.pop(key, None)
    done = walk(key, create=create)
    if done is None:
        return None
    _walks[key] = done
    _walks.setdefault(str(done.root), done)
    return done.root


def recheck(root: Path) -> None:
    """Before a load: ``root`` (from :func:`trusted_root`) still passes its walk; :class:`CacheDirError`
    if not. Cheap when nothing changed."""
    if trusted_root(root, create=False) is None:
        raise CacheDirError(f"flashsink cache directory {root} disappeared while in use")


def open_entry(path: Path) -> int:
    """An fd of the entry directory ``path`` (no link followed), checked private (:class:`CacheDirError`);
    OSError if it cannot be opened. The caller closes it."""
    fd = open_dir(path)
    try:
        check_private(path, os.fstat(fd), "entry is")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(path) -> int:
    """An fd of the directory ``path`` itself, never of a link's target (O_NOFOLLOW); OSError otherwise."""
    return os.open(path, _DIR_FLAGS)


def read_regular(name: str, dir_fd: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``name`` (relative to ``dir_fd``), no link followed, no FIFO waited
    on; ValueError saying why not. ``limit``: never more bytes read (a bigger or growing file is a
    ValueError)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{os.path.basename(name)} is not a regular file (a symlink)") from None
        raise ValueError(f"{os.path.basename(name)} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{os.path.basename(name)} is not a regular file")
        if limit is not None and st.st_size > limit:
            raise ValueError(f"{os.path.basename(name)} is larger than {limit} bytes")
        os.set_blocking(fd, True)
        bound = st.st_size if limit is None else limit
        chunks, left = [], bound + 1  # one byte more: a file that grew while read is seen
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ValueError(f"{os.path.basename(name)} is larger than {bound} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise ValueError(f"{os.path.basename(name)} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
