"""Shared test setup: private caches, the `gpu` skip and NaN-poisoned `torch.empty`.

Markers (l0, l1, l2, boundary, gpu) are registered in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
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


def pytest_unconfigure(config):
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
