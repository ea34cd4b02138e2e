"""Shared test setup: private caches, the `gpu` skip, NaN-poisoned `torch.empty` and `--record-kernels`.

Markers (l0, l1, l2, boundary, gpu) are registered in pyproject.toml.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile

# The suite leaves nothing in the user's home: unless the environment names them (tools/gpu_suite.sh
# points both at a warm cache in the checkout), flashsink's and TileLang's caches are one temporary
# directory for the session, removed at its end. Set here, at the conftest's import: before any test
# module imports flashsink or TileLang, and inherited by every process a test starts (compile children,
# parallel workers, xdist workers: they keep the directory the first process made).
_CACHE_VARS = ("FLASHSINK_CACHE_DIR", "TILELANG_CACHE_DIR")
_made_caches = None
if not all(os.environ.get(v) for v in _CACHE_VARS):
    _made_caches = tempfile.mkdtemp(prefix="flashsink-tests-")
    for _var, _sub in zip(_CACHE_VARS, ("flashsink", "tilelang")):
        if not os.environ.get(_var):
            os.environ[_var] = os.path.join(_made_caches, _sub)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--record-kernels", metavar="FILE",
        help="append every kernel a test asks flashsink for to FILE (one JSON object a line, what `flashsink "
        "precompile --recorded FILE` builds) instead of building it: the call stops there (KernelRecorded). "
        "tools/gpu_suite.sh runs the GPU tests once this way to learn which kernels to precompile.")


class KernelRecorded(RuntimeError):
    """Raised instead of building a kernel under ``--record-kernels``."""


def record_kernels(path, monkeypatch) -> None:
    """Replace ``registry.get_kernel``, where flashsink's modules look it up, by one that appends its
    ``(kind, cfg)`` to ``path`` (``kind`` and the KernelConfig fields) and raises KernelRecorded. A module
    imported later takes the replacement from ``registry`` itself."""
    from flashsink.ops.compiler import registry

    real = registry.get_kernel

    def get_kernel(kind, cfg):
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **dataclasses.asdict(cfg)}) + "\n")
        raise KernelRecorded(f"--record-kernels: recorded {kind} {cfg.short()}")

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "flashsink" and getattr(module, "get_kernel", None) is real:
            monkeypatch.setattr(module, "get_kernel", get_kernel)


_session_patch = pytest.MonkeyPatch()


def pytest_configure(config):
    path = config.getoption("--record-kernels")
    if path:
        record_kernels(path, _session_patch)


def pytest_unconfigure(config):
    _session_patch.undo()
    if _made_caches is not None:
        shutil.rmtree(_made_caches, ignore_errors=True)

_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _CUDA:
        return
    skip = pytest.mark.skip(reason="CUDA not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        with torch.no_grad():
            t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Fill floating results of torch.empty / torch.empty_like with NaN.

    An output or gradient buffer that a kernel allocates with torch.empty and then fails to
    write completely keeps NaN there, and the precision standard fails it.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return _poison(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield
