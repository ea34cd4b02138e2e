"""``--profile``: flashsink's fwd+bwd per kernel (torch.profiler), each kernel named by its role."""

from __future__ import annotations

import torch

from .flashsink_systems import FlashSink
from .problems import Problem
from .system import callables_of


_KERNEL_ROLES = (
    ("flashsink_fwd", "forward"),
    ("flashsink_bwd_preprocess", "preprocess (Delta, dsink, dQ accumulator zeroed)"),
    ("flashsink_bwd_postprocess", "postprocess (dQ cast)"),
    ("flashsink_bwd_dq", "dQ pass (deterministic)"),
    ("flashsink_bwd", "main backward"),
)


def kernel_role(name: str) -> str:
    for key, role in _KERNEL_ROLES:
        if key in name:
            return role
    low = name.lower()
    if "fill" in low or "zero" in low:
        return "torch fill (zeros)"
    if "copy" in low or "cast" in low or "elementwise" in low:
        return "torch copy / cast"
    return "other"


def profile_flashsink(prob: Problem, inp: dict, iters: int = 5) -> list[dict]:
    """Per-kernel device time of flashsink's fwd+bwd (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    calls, _ = callables_of(FlashSink(), prob, inp)
    calls["fwd+bwd"]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            calls["fwd+bwd"]()
        torch.cuda.synchronize()
    rows = {}
    events = list(prof.key_averages())

    def dev_us(evt):
        us = getattr(evt, "self_device_time_total", None)
        return getattr(evt, "self_cuda_time_total", 0.0) if us is None else us

    kernels = [e for e in events if str(getattr(e, "device_type", "")).split(".")[-1] == "CUDA"]
    if not kernels:  # older profilers: keep device-timed events that are not CPU-side aten ops
        kernels = [e for e in events if dev_us(e) > 0 and not e.key.startswith(("aten::", "cuda"))]
    for evt in kernels:
        us = dev_us(evt)
        if us <= 0:
            continue
        rows[evt.key] = {"kernel": evt.key, "role": kernel_role(evt.key),
                         "calls_per_iter": evt.count / iters, "us_per_iter": us / iters}
    out = sorted(rows.values(), key=lambda r: -r["us_per_iter"])
    total = sum(r["us_per_iter"] for r in out) or 1.0
    for r in out:
        r["share"] = 100.0 * r["us_per_iter"] / total
    return out
