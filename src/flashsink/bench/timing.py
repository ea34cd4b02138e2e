"""Timing: the median time of a call (L2 flushed between runs on CUDA), the ceilings of the floor,
peak memory and host time."""

from __future__ import annotations

import statistics
import time

import torch

from ..testing import dtype_name


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Median time of ``fn`` in ms. CUDA: triton.testing.do_bench when importable, else CUDA
    events; both flush the L2 between runs (a 256 MB write), so a small windowed problem whose
    inputs fit in the 50-60 MB L2 is not timed from a warm cache -- a real layer reads its q, k, v
    from HBM. CPU: time.perf_counter."""

    def __init__(self, device: str, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 10):
        self.device, self.warmup_ms, self.rep_ms, self.min_reps = device, warmup_ms, rep_ms, min_reps
        self.method = "perf_counter median"
        self._do_bench = None
        if device == "cuda":
            try:
                from triton.testing import do_bench

                self._do_bench = do_bench
                self.method = "triton.testing.do_bench median (L2 flushed between runs)"
            except Exception:  # noqa: BLE001
                self.method = "CUDA events median (L2 flushed between runs)"

    def __call__(self, fn) -> float:
        if self.device != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            est = max(time.perf_counter() - start, 1e-6) * 1e3
            n = max(self.min_reps, min(1000, int(self.rep_ms / est)))
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        if self._do_bench is not None:
            # do_bench repeats for rep_ms; a slow call (tens of ms at N = 16k) would get one or two
            # runs, so stretch rep_ms to at least min_reps calls (capped at ~3 s per row).
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            est = s.elapsed_time(e)
            rep = min(max(self.rep_ms, self.min_reps * est), max(self.rep_ms, 3000.0))
            return float(self._do_bench(fn, warmup=self.warmup_ms, rep=rep, return_mode="median"))
        return self._events(fn)

    def _events(self, fn) -> float:
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            flush.zero_()
            fn()
        e.record()
        torch.cuda.synchronize()
        est = max(s.elapsed_time(e) / 5, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        n = max(self.min_reps, min(int(self.rep_ms / est), 10000))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            flush.zero_()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)


def measure_ceilings(device: str, timer: Timer) -> dict:
    """The two ceilings of the floor, measured now: a matmul rate and a device copy rate."""
    if device == "cuda":
        n, dt = 8192, torch.bfloat16
        copy_bytes = 2**30
    else:
        n, dt = 512, torch.float32
        copy_bytes = 2**24
    gen = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)  # random, never zeros
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)
    ms_mm = timer(lambda: torch.matmul(a, b))
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    ms_cp = timer(lambda: dst.copy_(src))
    del a, b, src, dst
    return {
        "matmul_tflops": 2 * n**3 / (ms_mm * 1e-3) / 1e12,
        "matmul": f"{dtype_name(dt)} {n}x{n}x{n} torch.matmul",
        "copy_gbs": 2 * copy_bytes / (ms_cp * 1e-3) / 1e9,  # read + write
        "copy": f"device copy of {copy_bytes / 2**30:g} GiB (read+write counted)",
    }



def _peak_mib(fn, device) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


HOST_CALLS = 20  # calls enqueued back to back for the host time
HOST_MODES = ("fwd", "fwd+bwd")


def host_us(fn, device: str, calls: int = HOST_CALLS) -> float:
    """Host time per call in us: ``calls`` calls enqueued without a sync (the device may still be
    running them), divided by ``calls``. Run after warm-up: first-call compiles stay out."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / calls * 1e6


def time_row(row: dict, calls: dict, mode: str, device: str, timer, verdict: str, *, first_call=None) -> None:
    """Time ``calls[mode]`` into ``row``: one first call (any compile stays out of the timing; its
    seconds go to ``first_call`` when given), the peak memory, the median ms (``timer``) and, in
    :data:`HOST_MODES`, the host time per call of ``calls["host:" + mode]`` (the train step's
    ``.backward``) or of the call itself. On success the row's status is ``verdict`` and its rates and
    share of the floor follow; an exception while timing becomes the status instead."""
    try:
        t0 = time.perf_counter()
        calls[mode]()
        _sync(device)
        if first_call is not None:
            first_call(time.perf_counter() - t0)
        row["peak_mib"] = _peak_mib(calls[mode], device)
        ms = timer(calls[mode])
        if mode in HOST_MODES:
            host = calls.get("host:" + mode, calls[mode])
            host()  # its own first call
            row["host_us"] = host_us(host, device)
    except Exception as exc:  # noqa: BLE001
        row["status"] = f"error while timing: {type(exc).__name__}: {str(exc)[:200]}"
    else:
        row["status"] = verdict
        row["ms"] = ms
        row["tflops"] = row["flops"] / (ms * 1e-3) / 1e12
        row["gbs"] = row["bytes"] / (ms * 1e-3) / 1e9
        row["pct_floor"] = 100.0 * row["floor_ms"] / ms
