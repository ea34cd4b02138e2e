"""First use of a configuration (``registry.get_kernel`` missing): every kernel the configuration needs
is built at once, in parallel workers, then loaded; later launches are one dict lookup.

No kernel is compiled here: the disk cache and the workers are fakes (the workers are threads that
meet at a barrier, which they pass only if all of them run at the same time), and the real process
pool (``parallel.compile_parallel``, which ``flashsink precompile`` uses too) is covered by
tests/test_precompile_cli.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading

import pytest

from flashsink.errors import CompileError
from flashsink.ops.compiler import compile as compile_mod
from flashsink.ops.compiler import registry as parallel, registry
from flashsink.ops.compiler import kinds
from flashsink import kernel_config as config_mod
from flashsink.kernel_config import KernelConfig

pytestmark = pytest.mark.l0

CFG = KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=8, causal=True,
                   has_sinks=True, layout="bhsd", precision="fast", deterministic=False)


class FakeKernel:
    """A JITKernel's shape as get_kernel sees it: an adapter with the tvm_ffi executable."""

    def __init__(self, kind, cfg):
        self.kind, self.cfg = kind, cfg
        self.adapter = self
        self.result_idx = []
        self.executable = ("executable", kind, cfg)

    def get_exportable_executable(self):
        return self.executable


@pytest.fixture
def fake_build(monkeypatch):
    """A fresh in-process cache; a disk cache holding ``state["disk"]``; workers that record what they
    built (and only pass the barrier together). Returns the state."""
    state = {"disk": set(), "built": [], "loads": [], "fail": set(), "barrier": None}

    def compile_kernel(kind, cfg, *, load_only=False):
        cfg = kinds.canonical(kind, cfg)
        state["loads"].append((kind, load_only))
        if (kind, cfg) in state["disk"]:
            return FakeKernel(kind, cfg)
        if load_only:
            return None
        if kind in state["fail"]:
            raise CompileError(kind, cfg, cfg.target(), "fake failure")
        state["built"].append((kind, "in-process"))
        state["disk"].add((kind, cfg))  # compile_kernel stores what it compiles
        return FakeKernel(kind, cfg)

    def compile_one(job):
        kind, cfg = job
        if not state.get("no_barrier"):
            state["barrier"].wait(timeout=30)  # raises BrokenBarrierError unless every job runs at once
        if kind in state["fail"]:
            return kind, cfg, 0.0, "failed", "CompileError: fake failure"
        state["built"].append((kind, "worker"))
        state["disk"].add((kind, kinds.canonical(kind, cfg)))
        return kind, cfg, 0.0, "compiled", None

    class Pool(cf.ThreadPoolExecutor):
        def submit(self, fn, job, *a, **k):
            state["submitted"].append(job[0])
            return super().submit(fn, job, *a, **k)

    def executor(jobs):
        state["barrier"] = threading.Barrier(jobs)
        state["jobs"] = jobs
        state["submitted"] = []
        return Pool(max_workers=jobs)

    monkeypatch.setattr(registry, "_cache", {})
    monkeypatch.setattr(compile_mod, "compile_kernel", compile_kernel)
    monkeypatch.setattr(parallel, "compile_one", compile_one)
    monkeypatch.setattr(parallel, "executor", executor)
    monkeypatch.setattr(registry.os, "cpu_count", lambda: 16)
    return state


def test_first_use_builds_the_whole_set_in_parallel(fake_build, caplog):
    # (no bwd_split: the ws main backward runs unsplit, config.bwd_split)
    # (fwd_window: the forward for windows up to 128 keys, 64-key tiles with a GQA group packed,
    # config.fwd_window_tiles)
    assert kinds.kinds_for(CFG) == ("fwd", "fwd_window", "preprocess", "bwd", "postprocess", "fwd_split",
                                    "merge_splits")
    # a training call's first launch builds the forward and backward, not the decode pair
    needed = kinds.first_use_kinds("fwd", CFG)
    assert needed == ("fwd", "fwd_window", "preprocess", "bwd", "postprocess")
    with caplog.at_level(logging.INFO, logger="flashsink"):
        launcher = registry.get_kernel("fwd", CFG)
    assert launcher == ("executable", "fwd", kinds.canonical("fwd", CFG))  # the executable, not the adapter
    assert sorted(k for k, where in fake_build["built"]) == sorted(needed)
    # the longest build (the forward) in this process, which has its imports done; the others in
    # workers, one per kernel, all at once (the barrier passed), submitted longest first
    assert [k for k, where in fake_build["built"] if where == "in-process"] == ["fwd"]
    assert fake_build["submitted"] == ["fwd_window", "bwd", "preprocess", "postprocess"]
    assert fake_build["jobs"] == len(needed) - 1
    assert "compiling 5 kernels" in caplog.text and "in parallel" in caplog.text
    # every kernel of the configuration is now one dict lookup away, nothing else is built or loaded
    n = len(fake_build["loads"])
    for kind in needed:
        assert registry.get_kernel(kind, CFG)[1] == kind
    assert len(fake_build["loads"]) == n and len(fake_build["built"]) == len(needed)
    # the first decode launch builds the decode pair, together
    registry.get_kernel("fwd_split", CFG)
    assert fake_build["built"][len(needed):] == [("fwd_split", "in-process"), ("merge_splits", "worker")] or \
        fake_build["built"][len(needed):] == [("merge_splits", "worker"), ("fwd_split", "in-process")]
    assert fake_build["jobs"] == 1


def test_first_use_loads_cached_kernels_and_compiles_only_the_rest(fake_build):
    for kind in ("fwd", "bwd", "fwd_split"):
        fake_build["disk"].add((kind, kinds.canonical(kind, CFG)))
    registry.get_kernel("bwd", CFG)
    assert sorted(k for k, _ in fake_build["built"]) == ["fwd_window", "postprocess", "preprocess"]
    assert ("fwd_window", "in-process") in fake_build["built"]
    assert fake_build["jobs"] == 2


def test_first_use_workers_leave_a_core_to_this_process(fake_build, monkeypatch):
    monkeypatch.setattr(registry.os, "cpu_count", lambda: 3)
    fake_build["no_barrier"] = True  # fewer workers than kernels: they run in turns
    registry.get_kernel("fwd", CFG)
    assert fake_build["jobs"] == 2
    assert fake_build["submitted"] == ["fwd_window", "bwd", "preprocess", "postprocess"]
    assert sorted(k for k, _ in fake_build["built"]) == sorted(kinds.first_use_kinds("fwd", CFG))
    assert all(registry.get_kernel(k, CFG)[1] == k for k in kinds.first_use_kinds("fwd", CFG))


def test_first_use_takes_back_kernels_no_worker_started(fake_build, monkeypatch):
    """One worker, held on its first kernel until this process has built the forward: this process then
    builds the kernels still queued, longest first, instead of waiting for the worker."""
    monkeypatch.setattr(registry.os, "cpu_count", lambda: 2)
    release = threading.Event()
    fake_build["no_barrier"] = True
    real = parallel.compile_one

    def held(job):
        release.wait(timeout=30)
        return real(job)

    monkeypatch.setattr(parallel, "compile_one", held)
    real_ck = compile_mod.compile_kernel

    def compile_kernel(kind, cfg, *, load_only=False):
        out = real_ck(kind, cfg, load_only=load_only)
        if not load_only and kind == "postprocess":
            release.set()  # the last one this process takes: let the worker go on
        return out

    monkeypatch.setattr(compile_mod, "compile_kernel", compile_kernel)
    registry.get_kernel("fwd", CFG)
    assert fake_build["jobs"] == 1
    assert [k for k, where in fake_build["built"] if where == "in-process"] == ["fwd", "bwd", "preprocess",
                                                                                  "postprocess"]
    assert [k for k, where in fake_build["built"] if where == "worker"] == ["fwd_window"]
    assert all(registry.get_kernel(k, CFG)[1] == k for k in kinds.first_use_kinds("fwd", CFG))


def test_one_missing_kernel_compiles_in_process(fake_build):
    for kind in kinds.kinds_for(CFG):
        if kind != "postprocess":
            fake_build["disk"].add((kind, kinds.canonical(kind, CFG)))
    registry.get_kernel("fwd", CFG)
    assert fake_build["built"] == [("postprocess", "in-process")] and "jobs" not in fake_build


def test_a_failing_kernel_fails_its_own_launch_only(fake_build):
    fake_build["fail"].add("preprocess")
    assert registry.get_kernel("fwd", CFG)[1] == "fwd"  # the forward works
    with pytest.raises(CompileError):
        registry.get_kernel("preprocess", CFG)


def test_fields_a_kernel_does_not_read_share_one_build(fake_build):
    """fwd reads neither precision nor deterministic: the strict configuration loads the fast one's."""
    registry.get_kernel("fwd", CFG)
    built = len(fake_build["built"])
    strict = KernelConfig(**{**CFG.__dict__, "precision": "strict"})
    registry.get_kernel("fwd", strict)
    new = [k for k, _ in fake_build["built"][built:]]
    assert "fwd" not in new and "postprocess" not in new and "fwd_split" not in new
    # these read precision (strict has no split main backward; on Hopper it has the fp32-O forward and
    # Delta pass, config.fwd_o32)
    o32 = ["fwd_o32", "preprocess_o32"] if config_mod.fwd_o32(strict) else []
    assert sorted(new) == sorted(["bwd", "preprocess"] + o32)
