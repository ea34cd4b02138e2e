"""argparse helpers shared by the command-line tools: :func:`add_command` for each ``flashsink``
subcommand, and ``type=`` functions, so a bad value is a usage error (argparse prints
``error: argument --x: ...`` and exits 2), never a traceback later."""

from __future__ import annotations

import argparse


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return _within(x, x == x and abs(x) != float("inf"), "a finite number", text)


def _within(value, ok: bool, need: str, shown):
    """``value`` if ``ok``, else the usage error ``must be <need>, got <shown>``."""
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {need}, got {shown!r}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    n = _int(text)
    return _within(n, n >= 1, ">= 1", n)


def seed(text: str) -> int:
    """A seed for ``torch.Generator.manual_seed``: an int in ``[0, 2**64)``."""
    n = _int(text)
    return _within(n, 0 <= n < 1 << 64, "in [0, 2**64)", n)


def nonneg_float(text: str) -> float:
    """A finite float >= 0 (``nan``, ``inf`` and negatives are usage errors)."""
    x = _float(text)
    return _within(x, x >= 0, ">= 0", text)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    x = _float(text)
    return _within(x, x > 0, "> 0", text)


def add_command(sub, name: str, func=None, *, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` of ``sub`` (an ``add_subparsers()`` result): ``help`` is its line
    in the parent's command list, ``description`` heads its own ``--help``, and ``func(args)`` runs it
    (None for a command that only holds subcommands)."""
    p = sub.add_parser(name, help=help, description=description)
    if func is not None:
        p.set_defaults(func=func)
    return p
