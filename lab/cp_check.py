"""Multi-GPU check of context parallelism: ring and Ulysses attention against one GPU, and tokens/s.

UNTESTED ON GPUs: written without a multi-GPU machine; the same code paths are tested on CPU
processes with gloo (tests/test_ring.py, tests/test_distributed.py). Expect to fix small things on
its first run.

    torchrun --standalone --nproc-per-node 2 lab/cp_check.py --seq 32768
    torchrun --standalone --nproc-per-node 4 lab/cp_check.py --seq 131072 --methods ring

The problem is the golden config (fp16, B=1, H=64, H_kv=8, D=128, W=128, sinks) at the given
sequence length (``--window none`` for full causal). Every rank builds the same global inputs from
one seed and takes its shard (zig-zag for ring, contiguous for Ulysses). Rank 0 also runs the whole
problem on its GPU with ``flashsink.attention``; each method's output and gradients (q, k, v,
gathered and unsharded; sinks summed over ranks) are judged against that single-GPU result with the
precision standard's gate 1 (``flashsink.testing.check_precision``): the float64 reference the
standard normally uses is out of reach at these lengths, so this checks that splitting the problem
changes nothing beyond the kernels' own rounding.

Timing: CUDA events around forward and forward+backward, after warm-up, the median of ``--iters``
runs, with a barrier before each. Reported: ms, tokens/s (global tokens / time), speedup over the
single GPU and scaling efficiency (speedup / P).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are forced below): on shared hosts a
program using it can take the GPUs out of service.
"""

from __future__ import annotations

import argparse
import os
import statistics

# Before torch.distributed / NCCL read them.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashsink  # noqa: E402
from flashsink import testing  # noqa: E402
from flashsink.distributed import ring_attention, shard_sequence, ulysses_attention, unshard_sequence  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", default="128", help="an int, or 'none' for full causal")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--methods", default="ring,ulysses")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def timed(fn, iters, warmup):
    """Median ms of fn() (CUDA events), after warm-up; a barrier before each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    window = None if args.window.lower() == "none" else int(args.window)
    b, s, h, hk, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    kw = dict(window=window, causal=True, layout="bshd")

    x = testing.make_inputs(b, h, hk, s, s, d, dtype, dev, layout="bshd", seed=args.seed)
    sinks = x["sinks"]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"cp_check: P={p} {torch.cuda.get_device_name()} B={b} S={s} H={h} H_kv={hk} D={d} W={window} {args.dtype}")

    # Single GPU (rank 0): the result to match and the time to beat.
    single, t1 = None, {}
    if rank == 0:
        leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v")] + [sinks.clone().requires_grad_(True)]
        o = flashsink.attention(*leaves, **kw)
        o.backward(x["do"])
        single = dict(o=o.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad, dsink=leaves[3].grad)
        del o
        t1["fwd"] = timed(lambda: flashsink.attention(*leaves, **kw), args.iters, args.warmup)
        t1["fwd+bwd"] = timed(lambda: flashsink.attention(*leaves, **kw).backward(x["do"]), args.iters, args.warmup)
        for mode, ms in t1.items():
            say(f"  single GPU  {mode:8s} {ms:9.3f} ms  {b * s / ms * 1e3:12.0f} tokens/s")
    dist.barrier()

    failed = False
    for method in [m for m in args.methods.split(",") if m]:
        zigzag = method == "ring"
        fn = {"ring": ring_attention, "ulysses": ulysses_attention}[method]
        mkw = dict(kw, zigzag=True) if method == "ring" else dict(kw)
        local = [
            shard_sequence(x[n], rank, p, zigzag=zigzag).detach().clone().requires_grad_(True) for n in ("q", "k", "v")
        ]
        sk = sinks.clone().requires_grad_(True)
        do = shard_sequence(x["do"], rank, p, zigzag=zigzag).contiguous()
        o = fn(*local, sk, **mkw)
        o.backward(do)
        res = dict(o=o.detach(), dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
        gathered = {}
        for key, t in res.items():
            parts = [torch.empty_like(t) for _ in range(p)]
            dist.all_gather(parts, t.contiguous())
            gathered[key] = unshard_sequence(parts, zigzag=zigzag)
        ds = sk.grad.clone()
        dist.all_reduce(ds)
        gathered["dsink"] = ds
        if rank == 0:
            for key, a in gathered.items():
                rep = testing.check_precision(f"{method} {key}", a, single[key], dtype)
                ok = rep.gate1_ratio_ok and rep.gate1_max_ok
                failed |= not ok
                say(f"  {method:8s} {key:6s} max|a-e| {rep.max_abs:.3e}  within tol {100 * rep.ratio:.3f}%  "
                    f"{'PASS' if ok else 'FAIL'}")
        del o, res, gathered
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":
                ms = timed(lambda: fn(*local, sk, **mkw), args.iters, args.warmup)
            else:
                ms = timed(lambda: fn(*local, sk, **mkw).backward(do), args.iters, args.warmup)
            if rank == 0:
                speedup = t1[mode] / ms
                say(f"  {method:8s} {mode:8s} {ms:9.3f} ms  {b * s / ms * 1e3:12.0f} tokens/s  "
                    f"speedup {speedup:5.2f}x  efficiency {100 * speedup / p:5.1f}%")
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
