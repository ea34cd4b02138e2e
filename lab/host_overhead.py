"""Host time per ``flashsink.attention`` call (the Python between the user and the kernels).

    python lab/host_overhead.py            # CUDA if available, else --cpu
    python lab/host_overhead.py --cpu      # no GPU: the CUDA code path with CPU tensors
    python lab/host_overhead.py --floor    # the autograd engine's own cost (any op pays it)

CUDA: the GPU is first kept busy with ``torch.cuda._sleep`` (longer than the measured calls),
so the wall time of N calls is the host's alone (launches only queue); then the same calls
back to back with a sync give the GPU time per call for comparison.

--cpu: the CUDA path (validation, ``kernel_attention`` / ``kernel_attention_varlen``, the eager
``attention._Attention`` autograd.Function, or with ``--route ops`` the ``flashsink::fwd`` / ``bwd`` /
``varlen_fwd`` / ``varlen_bwd`` custom ops (what a torch.compile trace runs) with their CUDA
implementations registered for CPU tensors, and the launch layer ``launch.dense``) runs on CPU tensors
with every kernel a no-op (the kernel cache answers a no-op for every key) and the
architecture reported as sm_90a. CPU allocations and fills cost less
than CUDA ones (no launch), so this measures the Python part, not the whole host time.

--floor: no flashsink at all; what the autograd engine costs per fwd+bwd whatever the op: an
``autograd.Function`` that launches nothing, a built-in op (``x * 2``, a C++ autograd node) and the
Function's forward alone. The host-time target of one fwd+bwd cannot go below the built-in op's row.

Prints the minimum (and median) over ``--repeats`` of the mean over ``--iters`` calls, in microseconds:
on a shared machine the minimum is the steadiest estimate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _noop_kernels():
    from flashsink.ops.compiler import registry

    def noop(*args):
        return None

    class NoopCache(dict):
        def get(self, key, default=None):
            return noop

    registry._cache = NoopCache()


def _fake_cuda(route: str):
    """Run the CUDA implementations on CPU tensors (this process only)."""
    from flashsink.ops.launch import attention, custom_ops, dense
    from flashsink import kernel_config as config

    if route == "eager":
        attention._eager = lambda q: True
    config._arch_of_index = lambda index: "sm_90a"
    torch.cuda.current_device = lambda: 0
    dense._sm_count = lambda index: 132
    _noop_kernels()
    custom_ops.fwd.register_kernel("cpu")(lambda *a: custom_ops._fwd_cuda(*a))
    custom_ops.bwd.register_kernel("cpu")(lambda *a: custom_ops._bwd_cuda(*a))
    custom_ops.varlen_fwd.register_kernel("cpu")(lambda *a: custom_ops._varlen_fwd_cuda(*a))
    custom_ops.varlen_bwd.register_kernel("cpu")(lambda *a: custom_ops._varlen_bwd_cuda(*a))


def _kvcache_calls(device: str, b, h, hk, n, d, page_size, dtype):
    """Paged decode: one query per row against ``n`` cached keys, pages of ``page_size``."""
    import flashsink
    from flashsink import api

    g = torch.Generator().manual_seed(0)
    pages = -(-n // page_size)
    kc = torch.randn(b * pages, page_size, hk, d, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(b, 1, h, d, generator=g).to(device=device, dtype=dtype)
    table = torch.randperm(b * pages, generator=g).to(device=device, dtype=torch.int32).view(b, pages)
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    sinks = torch.zeros(h, device=device)
    if device == "cuda":
        def fwd():
            with torch.inference_mode():
                flashsink.attention_kvcache(q, kc, kc, lens, block_table=table, sinks=sinks, layout="bshd")
    else:  # api.attention_kvcache's CUDA branch
        def fwd():
            with torch.inference_mode():
                spec = api.validate_kvcache(q, kc, kc, lens, table, sinks, window=None, scale=None, return_lse=False,
                                            layout="bshd")
                api.kernel_attention_kvcache(spec, q, kc, kc, lens, table, sinks, return_lse=False)
    return {"fwd": fwd}


def _calls(device: str, b, h, hk, n, d, window, dtype, varlen_seqs: int, seq_q=None):
    import flashsink
    from flashsink import api, testing

    if seq_q is not None:  # decode: fewer queries than keys, forward only
        inp = testing.make_inputs(b, h, hk, seq_q, n, d, dtype, device, seed=0)
    elif varlen_seqs:
        inp = testing.make_inputs(1, h, hk, n, n, d, dtype, device, layout="bshd", seed=0)
        for x in ("q", "k", "v", "do"):
            inp[x] = inp[x][0]
        step = n // varlen_seqs
        cu = torch.tensor([min(i * step, n) for i in range(varlen_seqs)] + [n], dtype=torch.int32, device=device)
        m = int((cu[1:] - cu[:-1]).max())
    else:
        inp = testing.make_inputs(b, h, hk, n, n, d, dtype, device, seed=0)
    leaves = [inp[x].detach().clone().requires_grad_(True) for x in ("q", "k", "v", "sinks")]
    do = inp["do"]

    if device == "cuda":
        if varlen_seqs:
            def attn(q, k, v, s):
                return flashsink.attention_varlen(q, k, v, cu, cu, m, m, s, window=window)
        else:
            def attn(q, k, v, s):
                return flashsink.attention(q, k, v, s, window=window)
    else:  # api.attention's CUDA branch (q.is_cuda is False here)
        from flashsink.ops.launch.attention import kernel_attention_varlen

        def attn(q, k, v, s):
            if varlen_seqs:
                spec = api.validate_varlen(q, k, v, cu, cu, m, m, s, window=window, causal=True, scale=None)
                api.check_flags(return_lse=False, deterministic=False)
                # pad_head_dims: as on CUDA (its default there is q.is_cuda)
                return kernel_attention_varlen(spec, q, k, v, cu, cu, s, pad_head_dims=True)
            spec = api.validate_attention(q, k, v, s, window=window, causal=True, scale=None, layout="bhsd")
            api.check_flags(return_lse=False, deterministic=False)
            return api.kernel_attention(spec, q, k, v, s)

    def fwd():
        with torch.no_grad():
            attn(*leaves)

    def fwd_bwd():
        o = attn(*leaves)
        torch.autograd.grad(o, leaves, do)

    state = {}

    def bwd():
        if "o" not in state:
            state["o"] = attn(*leaves)
        torch.autograd.grad(state["o"], leaves, do, retain_graph=True)

    if seq_q is not None:
        return {"fwd": fwd}
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class _Nothing(torch.autograd.Function):
    """A Function that launches nothing: the engine's and the Python Function's cost alone."""

    @staticmethod
    def forward(ctx, q, k, v, s):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return q, k, v, None


def _floor_calls(device):
    """``--floor``'s calls: the autograd engine's cost per fwd+bwd, with and without a Python Function."""
    leaves = [torch.randn(4, 8, device=device, requires_grad=True) for _ in range(3)]
    leaves.append(torch.randn(4, device=device, requires_grad=True))
    do = torch.randn(4, 8, device=device)

    def function_fwd_bwd():
        torch.autograd.grad(_Nothing.apply(*leaves), leaves[:3], do)

    def builtin_fwd_bwd():
        torch.autograd.grad(leaves[0] * 2.0, leaves[:1], do)

    return {"Function (no launches) fwd+bwd": function_fwd_bwd, "built-in op x*2 fwd+bwd": builtin_fwd_bwd,
            "Function fwd alone": lambda: _Nothing.apply(*leaves)}


def _host_us(fn, iters, repeats, device):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles: the queue never drains while we time
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return min(out), statistics.median(out)


def _gpu_us(fn, iters, repeats):
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / iters * 1e3)
    return statistics.median(out)


PROBLEMS = {
    # name: B, H, H_kv, N, D, W (kvcache: page size), dtype, varlen sequences (0: dense) or the kind
    "golden": (1, 64, 8, 4096, 128, 128, torch.float16, 0),
    "gptoss-swa": (1, 64, 8, 4096, 64, 128, torch.bfloat16, 0),
    "varlen": (1, 64, 8, 4096, 64, 128, torch.bfloat16, 16),
    # decode (attention, 1 query against N keys) and paged decode (attention_kvcache, pages of 16)
    "decode": (8, 64, 8, 4096, 64, None, torch.bfloat16, "decode"),
    "kvcache": (8, 64, 8, 4096, 64, 16, torch.bfloat16, "kvcache"),
}
CPU_PROBLEMS = {  # tiny: CPU fills (synchronous here, queued on CUDA) stay negligible; the Python is the same
    "golden": (1, 2, 1, 128, 128, 128, torch.float16, 0),
    "gptoss-swa": (1, 2, 1, 128, 64, 128, torch.bfloat16, 0),
    "varlen": (1, 2, 1, 128, 64, 128, torch.bfloat16, 4),
    "decode": (2, 8, 1, 1024, 64, None, torch.bfloat16, "decode"),  # >= 512 keys: the split-KV path
    "kvcache": (2, 8, 1, 1024, 64, 16, torch.bfloat16, "kvcache"),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--problems", default=",".join(PROBLEMS))
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="also run cProfile over --iters calls of MODE (fwd, bwd, fwd+bwd) per problem, the GPU "
                        "kept busy, and print the 25 functions of most own time (where the host time goes)")
    p.add_argument("--torch-profile", default=None, metavar="MODE",
                   help="also run torch.profiler over --iters calls of MODE, the GPU kept busy, and print the "
                        "operators and CUDA runtime calls of most self CPU time")
    p.add_argument("--route", choices=("eager", "ops"), default="eager",
                   help="--cpu only: the eager autograd.Function (what CUDA tensors take) or the custom ops")
    p.add_argument("--floor", action="store_true",
                   help="only the autograd engine's own cost per fwd+bwd (no flashsink): a Function that launches "
                        "nothing, a built-in op, the Function's forward alone")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    if args.floor:
        if device == "cpu":
            torch.set_num_threads(1)
        print(f"device {device}: the autograd engine's floor (no flashsink)")
        for label, fn in _floor_calls(device).items():
            best, med = _host_us(fn, args.iters, args.repeats, device)
            print(f"{label:<34} host {best:8.1f} us/call (min of {args.repeats}; median {med:.1f})", flush=True)
        return
    if device == "cpu":
        _fake_cuda(args.route)
        torch.set_num_threads(1)
    table = CPU_PROBLEMS if device == "cpu" else PROBLEMS
    print(f"device {device}" + (f" (CUDA path, {args.route} route, on CPU tensors, kernels no-ops, tiny shapes)"
                                if device == "cpu" else
                                f" {torch.cuda.get_device_name()}"))
    for name in args.problems.split(","):
        b, h, hk, n, d, w, dt, seqs = table[name]
        if seqs == "kvcache":
            calls = _kvcache_calls(device, b, h, hk, n, d, w, dt)
        elif seqs == "decode":
            calls = _calls(device, b, h, hk, n, d, w, dt, 0, seq_q=1)
        else:
            calls = _calls(device, b, h, hk, n, d, w, dt, seqs)
        for mode, fn in calls.items():
            best, med = _host_us(fn, args.iters, args.repeats, device)
            line = f"{name:<11} {mode:<8} host {best:8.1f} us/call (min of {args.repeats}; median {med:.1f})"
            if device == "cuda":
                line += f"   gpu (back to back) {_gpu_us(fn, args.iters, args.repeats):8.1f} us/call"
            print(line, flush=True)
        if args.profile and args.profile in calls:
            _profile(calls[args.profile], args.iters, device, f"{name} {args.profile}")
        if args.torch_profile and args.torch_profile in calls:
            _torch_profile(calls[args.torch_profile], args.iters, device, f"{name} {args.torch_profile}")


def _torch_profile(fn, iters, device, label):
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    print(f"--- torch.profiler, {label}, {iters} calls (self CPU time; divide by {iters} per call)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
          flush=True)


def _profile(fn, iters, device, label):
    import cProfile
    import io
    import pstats

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"--- cProfile, {label}, {iters} calls (own time; divide by {iters} per call)")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000], flush=True)


if __name__ == "__main__":
    main()
