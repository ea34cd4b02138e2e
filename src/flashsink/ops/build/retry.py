"""Compile failures: which are transient, what a :class:`flashsink.CompileError` says, and the
compile with retries.

A transient failure (a killed compiler, a full disk, no memory) is retried ``COMPILE_RETRIES`` times,
``RETRY_DELAY_S`` seconds apart times the attempt, before it raises.
"""

from __future__ import annotations

import errno
import subprocess
import time
import traceback
from pathlib import Path

from ...errors import CompileError, tail
from . import diskcache, lowering
from .keys import CompileArgs
from .logs import log

#: extra attempts after a transient failure (so at most 1 + COMPILE_RETRIES compiles)
COMPILE_RETRIES = 2
RETRY_DELAY_S = 1.0

_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EMFILE,
                     errno.ENFILE, errno.ETXTBSY}
_TRANSIENT_TEXT = ("No space left on device", "Disk quota exceeded", "Cannot allocate memory", "out of memory",
                   "Resource temporarily unavailable", "Too many open files", "died due to signal",
                   "Killed", "killed", "timed out")


def compiler_output(exc: BaseException) -> str:
    """The exception text without the CUDA source TileLang puts in front of nvcc's output."""
    text = str(exc)
    marker = "Compilation error:"
    return text[text.rfind(marker):] if marker in text else text


def is_transient(exc: BaseException) -> bool:
    """Failures worth another try: the compiler was killed or timed out, or the machine ran out
    of disk, memory or file handles. Errors in the kernel or the compiler's verdict are not."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (MemoryError, subprocess.TimeoutExpired)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        if any(t in compiler_output(exc) for t in _TRANSIENT_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def error_text(exc: BaseException) -> str:
    """What a :class:`flashsink.CompileError` reports of ``exc``: nvcc's output, or the lowering's message."""
    if "Compilation error:" in str(exc):  # nvcc's verdict: its output is what matters
        return tail(compiler_output(exc))
    # a lowering or front-end error: the message and where it was raised
    return tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4)))


def compile_with_retries(kind: str, cfg, func, args: CompileArgs, root: Path):
    """:func:`lowering.jit` in the cache's private temp directory, then :func:`lowering.check_source`;
    transient failures retried, the rest raised as :class:`flashsink.CompileError`."""
    attempt = 0
    while True:
        attempt += 1
        try:
            with diskcache.private_tmp(root):
                kernel = lowering.jit(func, cfg, args)
            lowering.check_source(kernel.get_kernel_source() or "")
            return kernel
        except Exception as exc:
            if attempt <= COMPILE_RETRIES and is_transient(exc):
                log.warning(
                    "flashsink: compiling %s for %s failed with a transient error (%s); retry %d of %d",
                    kind, cfg.short(), tail(compiler_output(exc), 300).replace("\n", " "), attempt, COMPILE_RETRIES,
                )
                time.sleep(RETRY_DELAY_S * attempt)
                continue
            raise CompileError(kind, cfg, cfg.target(), error_text(exc), attempts=attempt) from exc
