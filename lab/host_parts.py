"""What each piece of the eager host path costs on this machine (CUDA only): the GPU kept busy by
``torch.cuda._sleep`` so every call only queues, each piece timed alone over ``--iters`` calls.

    python lab/host_parts.py [--problem golden|gptoss-swa] [--iters 100]

Pieces: torch allocations and fills, a view, each launcher of the problem's kernels with its real
arguments (the tvm_ffi call: argument conversion, TileLang's host checks, TMA descriptors, the
launch), an autograd.Function that launches nothing (the engine's own cost per fwd+bwd), a built-in
op's fwd+bwd (``q * 2``: what any op pays the autograd engine, C++ node included: the floor under a
host-time target), the library's forward and fwd+bwd. Prints the minimum over ``--repeats`` of the mean, in us.
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, iters, repeats):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(int(5e8))
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return best


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s):
        ctx.save_for_backward(q, k, v, s)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v, s = ctx.saved_tensors
        return do, None, None, None


def main(argv=None):
    import flashsink
    from flashsink import api, testing
    from flashsink.ops.compiler import registry
    from flashsink.ops.launch import dense

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problem", default="golden")
    p.add_argument("--iters", type=int, default=100)  # x 7 launches: under the ~1024 a queue holds
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-unheld", action="store_true",
                   help="torch.profiler over 20 train steps with the GPU free (the benchmark's host row)")
    a = p.parse_args(argv)
    d, dt = (128, torch.float16) if a.problem == "golden" else (64, torch.bfloat16)
    inp = testing.make_inputs(1, 64, 8, 4096, 4096, d, dt, "cuda", seed=0)
    leaves = [inp[x].detach().clone().requires_grad_(True) for x in ("q", "k", "v", "sinks")]
    q, k, v, s = (x.detach() for x in leaves)  # the launch layer's own calls take no autograd leaves
    do = inp["do"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, problem {a.problem}; "
          f"torch.Tensor.__dlpack_c_exchange_api__: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
    rows = []

    def row(name, fn):
        rows.append((name, timed(fn, a.iters, a.repeats)))
        print(f"{name:<44} {rows[-1][1]:8.2f} us", flush=True)

    row("torch.empty 4 MB", lambda: torch.empty(1 << 20, device="cuda"))
    row("torch.zeros 4 MB", lambda: torch.zeros(1 << 20, device="cuda"))
    row("torch.empty_like(q)", lambda: torch.empty_like(q))
    buf = torch.empty(1 << 20, device="cuda")
    row("view", lambda: buf[:1000].view(10, 100))
    row("torch.cuda.current_stream()", torch.cuda.current_stream)

    spec = api.validate_attention(q, k, v, s, window=128, causal=True, scale=None, layout="bhsd")
    row("validate_attention", lambda: api.validate_attention(q, k, v, s, window=128, causal=True, scale=None,
                                                              layout="bhsd"))
    plan, q, k, v, s32 = dense.prepare(spec, q, k, v, s)
    cfg, window = plan.cfg, plan.window
    with torch.no_grad():
        o, lse = dense.forward(plan, q, k, v, s32)
    fwd = registry.get_kernel("fwd", cfg)
    row(f"launcher fwd ({type(fwd).__name__})",
        lambda: fwd(q, k, v, s32, window, float(spec.scale) * 1.4426950408889634, o, lse))
    main_fn = getattr(fwd, "main", None)
    if main_fn is not None:
        row("launcher fwd .main", lambda: main_fn(q, k, v, s32, window, float(spec.scale) * 1.4426950408889634,
                                                  o, lse))
    row("get_kernel lookup", lambda: registry.get_kernel("fwd", cfg))
    row("dense.prepare", lambda: dense.prepare(spec, q, k, v, s))
    row("dense.forward", lambda: dense.forward(plan, q, k, v, s32))
    row("dense.backward", lambda: dense.backward(plan, do, q, k, v, o, lse, None, s32))

    def nothing():
        out = _Nothing.apply(*leaves)
        torch.autograd.grad(out, leaves[:1], do)

    row("autograd.Function, no launches, fwd+bwd", nothing)

    def nothing_backward():
        out = _Nothing.apply(*leaves)
        out.backward(do)

    row("  same, .backward() into .grad", nothing_backward)

    def builtin():  # the engine's floor for any op: one built-in op (C++ autograd node) and its backward
        out = leaves[0] * 2.0
        torch.autograd.grad(out, leaves[:1], do)

    row("built-in op q*2, fwd+bwd (engine floor)", builtin)

    def builtin_train():
        leaves[0].grad = None
        (leaves[0] * 2.0).backward(do)

    row("  same, .backward() into .grad", builtin_train)
    row("flashsink.attention fwd (no grad)", lambda: flashsink.attention(q, k, v, s, window=128))

    def fb():
        out = flashsink.attention(*leaves, window=128)
        torch.autograd.grad(out, leaves, do)

    row("flashsink.attention fwd+bwd (autograd.grad)", fb)
    def train_step():  # as the benchmark's host row: zero_grad(set_to_none=True), then .backward()
        for x in leaves:
            x.grad = None
        flashsink.attention(*leaves, window=128).backward(do)

    row("flashsink fwd+bwd as a train step (.backward)", train_step)
    train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):  # the benchmark's own way (bench/timing.host_us): no sleep, no sync inside
        train_step()
    rows.append(("  same, the bench's way (20 calls, GPU not held)", (time.perf_counter() - t0) / 20 * 1e6))
    torch.cuda.synchronize()
    print(f"{rows[-1][0]:<44} {rows[-1][1]:8.2f} us", flush=True)

    if a.profile_unheld:  # what the host waits on when the GPU runs the calls meanwhile
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                train_step()
        torch.cuda.synchronize()
        print("--- torch.profiler, 20 train steps, GPU not held (self CPU time)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50),
              flush=True)

    def chain(n):  # n layers, one backward: what a model's step pays per attention layer
        def step():
            for x in leaves:
                x.grad = None
            x = leaves[0]
            for _ in range(n):
                x = flashsink.attention(x, leaves[1], leaves[2], leaves[3], window=128)
            x.backward(do)
        return step

    one, eight = timed(chain(1), 50, a.repeats), timed(chain(8), 10, a.repeats)
    rows.append(("fwd+bwd per layer, 8 layers one backward", (eight - one) / 7))
    print(f"{rows[-1][0]:<44} {rows[-1][1]:8.2f} us", flush=True)
    print("\nsummary (us per call, GPU kept busy)")
    for name, us in rows:
        print(f"  {name:<44} {us:8.2f}")


if __name__ == "__main__":
    main()
