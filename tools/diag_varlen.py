"""Device diagnostics: varlen kernels stage by stage (each case in its own process, launches
blocking, so a failing kernel is named), and the host cost of one attention call.

    python tools/diag_varlen.py            # everything
    python tools/diag_varlen.py case NAME  # one case (used by the parent)
"""

import os
import subprocess
import sys
import time

import torch

CASES = {
    "one-256": ((256,), None),
    "one-200": ((200,), None),
    "two": ((256, 100), None),
    "zero-one": ((0, 1, 190), None),
    "prefill": ((5, 100), (300, 100)),
}


def cfg_for(layout, dtype="bfloat16", d=64, groups=4, det=False):
    from flashsink.ops.config import KernelConfig, arch_of

    return KernelConfig(arch=arch_of(torch.device("cuda")), dtype=dtype, head_dim=d, head_dim_v=d, groups=groups,
                        causal=True, has_sinks=True, layout=layout, deterministic=det)


def run_case(name):
    from flashsink.ops import varlen
    from flashsink.ops.compile import get_kernel
    from flashsink.ops.config import NO_WINDOW

    lq, lk = CASES[name]
    lk = lk or lq
    H, Hk, D = 8, 2, 64
    cfg = cfg_for("thd")
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(lq), cu(lk)
    q = torch.randn(sum(lq), H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), Hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), Hk, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    s = torch.randn(H, device="cuda")
    from dataclasses import replace

    from flashsink._validate import validate_varlen

    spec = validate_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), s, window=None, causal=True, scale=None)
    spec = replace(spec, layout="thd")
    w = NO_WINDOW
    o, lse = varlen._forward(q, k, v, s, cu_q, cu_k, cfg, spec, w)
    torch.cuda.synchronize()
    print(f"  {name}: fwd ok", flush=True)
    rows = lse.shape[-1]
    delta = torch.empty((H, rows), dtype=torch.float32, device="cuda")
    dlse = torch.zeros((H, rows), dtype=torch.float32, device="cuda")
    dsink = torch.zeros((H,), dtype=torch.float32, device="cuda")
    part = torch.zeros((spec.batch, H, 1), dtype=torch.float32, device="cuda")
    get_kernel("preprocess", cfg)(q, k, v, do, lse, dlse, s, cu_q, cu_k, spec.seq_q, w, float(spec.scale), delta, dsink, part)
    torch.cuda.synchronize()
    print(f"  {name}: preprocess ok", flush=True)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    acc = torch.zeros((H, rows, D), dtype=torch.float32, device="cuda")
    get_kernel("bwd", cfg)(q, k, v, do, lse, delta, cu_q, cu_k, spec.seq_kv, w, float(spec.scale), acc, dk, dv)
    torch.cuda.synchronize()
    print(f"  {name}: bwd ok", flush=True)
    get_kernel("postprocess", cfg)(acc, dq)
    torch.cuda.synchronize()
    print(f"  {name}: postprocess ok", flush=True)


def host_cost():
    import flashsink
    from flashsink.ops.compile import get_kernel

    for label, dt, d in (("golden fwd", torch.float16, 128), ("gptoss-swa fwd", torch.bfloat16, 64)):
        q = torch.randn(1, 64, 4096, d, device="cuda", dtype=dt)
        k = torch.randn(1, 8, 4096, d, device="cuda", dtype=dt)
        v = torch.randn(1, 8, 4096, d, device="cuda", dtype=dt)
        s = torch.randn(64, device="cuda")
        call = lambda: flashsink.attention(q, k, v, s, window=128)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            call()
        e1.record()
        torch.cuda.synchronize()
        loop = e0.elapsed_time(e1) / n
        # the raw kernel call alone
        cfg = cfg_for("bhsd", "float16" if dt == torch.float16 else "bfloat16", d, 8)
        kern = get_kernel("fwd", cfg)
        o = torch.empty_like(q)
        lse = torch.empty(1, 64, 4096, device="cuda")
        s32 = s.float()
        raw = lambda: kern(q, k, v, s32, 128, 0.1, o, lse)
        raw()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            raw()
        raw_host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        e0.record()
        for _ in range(n):
            raw()
        e1.record()
        torch.cuda.synchronize()
        raw_loop = e0.elapsed_time(e1) / n
        print(f"  {label}: api host {host*1e3:.3f} ms/call, back-to-back {loop:.3f} ms/call | "
              f"raw kernel host {raw_host*1e3:.3f} ms/call, back-to-back {raw_loop:.3f} ms/call", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "case":
        run_case(sys.argv[2])
        sys.exit(0)
    from flashsink.ops.precompile import precompile

    precompile([cfg_for("thd"), cfg_for("bhsd", "float16", 128, 8), cfg_for("bhsd", "bfloat16", 64, 8)])
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for name in CASES:
        r = subprocess.run([sys.executable, __file__, "case", name], env=env, capture_output=True, text=True, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()
        print(f"case {name}: rc={r.returncode}")
        print("\n".join(l for l in tail if "ok" in l or "Error" in l or "error" in l)[-1500:])
    san = subprocess.run("which compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer", shell=True, capture_output=True, text=True).stdout.strip().splitlines()
    if san:
        r = subprocess.run([san[0], "--print-limit", "5", sys.executable, __file__, "case", "zero-one"], capture_output=True, text=True, timeout=240)
        print("compute-sanitizer zero-one:\n" + (r.stdout + r.stderr)[-4000:])
    else:
        print("no compute-sanitizer")
    host_cost()
