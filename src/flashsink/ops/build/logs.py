"""flashsink's logger and ``FLASHSINK_LOG``.

Every module of the build layer logs to the "flashsink" logger (``log``); :func:`configure_logging`
applies ``FLASHSINK_LOG`` to it, once per process (``compile.compile_kernel`` calls it).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("flashsink")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}
_logging_done = False


def configure_logging() -> None:
    """Apply ``FLASHSINK_LOG`` (debug, info, warning, error, off) to the "flashsink" logger, once
    per process. Without it the level is info, unless the application set the logger's level
    itself. When the application has not configured logging (no handler on the root logger), a
    stderr handler is added so the lines are seen."""
    global _logging_done
    if _logging_done:
        return
    _logging_done = True
    given = os.environ.get("FLASHSINK_LOG", "").strip().lower()
    level = _LEVELS.get(given) if given else None
    if given and level is None:
        log.warning("flashsink: FLASHSINK_LOG=%r is not one of %s; using info", given, ", ".join(_LEVELS))
        level = logging.INFO
    if level is not None:
        log.setLevel(level)
    elif log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
