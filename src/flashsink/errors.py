"""flashsink's own exception types (importing this module imports nothing heavy)."""

from __future__ import annotations

#: How much of the compiler's output a :class:`CompileError` keeps (the end is where nvcc
#: and TileLang say what went wrong; the start of TileLang's message is the whole CUDA source).
STDERR_TAIL_CHARS = 4000


def tail(text: str, limit: int = STDERR_TAIL_CHARS) -> str:
    """The last ``limit`` characters of ``text``, cut at a line start when one is near."""
    text = text.rstrip()
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    if 0 <= newline < 200:
        cut = cut[newline + 1:]
    return "...\n" + cut


class CompileError(RuntimeError):
    """A kernel failed to compile.

    Attributes:
        kind: the kernel (``"fwd"``, ``"bwd"``, ...).
        config: the :class:`~flashsink.kernel_config.KernelConfig` it was compiled for.
        target: the TileLang target (``{"kind": "cuda", "arch": ...}``).
        stderr_tail: the end of the compiler's output / the exception text.
        attempts: how many times the compile was tried (transient failures are retried).
    """

    def __init__(self, kind: str, config, target, stderr_tail: str, attempts: int = 1):
        self.kind = kind
        self.config = config
        self.target = target
        self.stderr_tail = stderr_tail
        self.attempts = attempts
        short = config.short() if hasattr(config, "short") else repr(config)
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(
            f"flashsink: compiling the {kind} kernel for {short} (target {target}) failed{tries}.\n"
            f"configuration: {config!r}\n"
            f"compiler output (last lines):\n{stderr_tail}"
        )

    def __reduce__(self):  # picklable, so precompile's worker processes can return it
        return (type(self), (self.kind, self.config, self.target, self.stderr_tail, self.attempts))


class CacheDirError(PermissionError):
    """The kernel cache directory is not safe to load native code from (or cannot be made).

    The cache holds shared libraries that are loaded into the process, so it must be owned by
    the current user and writable by nobody else.
    """
