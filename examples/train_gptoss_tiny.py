#!/usr/bin/env python
"""Train a tiny gpt-oss (Hugging Face ``GptOssForCausalLM``, random init, no download) on random tokens,
once with ``attn_implementation="sink_attention"`` (flashsink's) and once with ``"eager"`` from the same
initial weights, and check that the two loss curves agree.

    python examples/train_gptoss_tiny.py                 # CPU, float32, 200 steps (a few minutes at most)
    python examples/train_gptoss_tiny.py --steps 20
    python examples/train_gptoss_tiny.py --device cuda   # bfloat16 (the CUDA kernels take fp16/bf16)
    python examples/train_gptoss_tiny.py --device cuda --precision strict

The model: 2 layers, hidden 256, 8 query heads, 2 kv heads, head dim 64, sliding window 16 on the first
layer (full attention on the second), 4 experts (top 2), vocabulary 128. The data: a fixed set of random
sequences, so the loss falls as the model memorises them. Both runs see the same batches in the same
order. In float32 the run fails (exit 1) when the curves differ by more than ``--rtol`` (relative, per
step, default 1e-3). Needs ``pip install 'flashsink[hf]'``.

In bfloat16/float16 two correct implementations do not stay within a fixed distance: every step rounds
the weights to 8 (or 11) bits, and the difference grows with training (measured on an H200, bf16,
120 steps: flashsink and eager 4e-2 apart at step 90). So a third run, eager in float32 from the same
(rounded) initial weights, is the reference curve, and the low-precision check is the precision
standard's gate 2 applied to the curves: flashsink's largest relative distance to the float32 curve
must not exceed twice eager's own plus one ulp of the format (``--rtol`` overrides that ulp). That is
the criterion of ``--precision strict``; with ``--precision fast`` (the default, as in flashsink) the
factor is the fast gate's element guard, 4 (``flashsink.testing.FAST_MAX_FACTOR``), in place of gate 2's
2. The fast gate's L2 part (1.5x eager's) is not applied to a curve: two bf16 trainings drift apart
chaotically whatever the attention, so the ratio of two such distances is not the attention's to judge.
Off CUDA ``--precision`` changes nothing (the reference is exact either way).

Training amplifies rounding differences step after step (a router that flips one token to another
expert is enough), so two correct fp32 implementations drift apart slowly. With the defaults
(CPU, fp32, 200 steps, 64 sequences, lr 5e-4) the loss falls from 4.87 to about 0.08 and the curves
stay within ~3e-5 of each other; much longer runs or a higher learning rate can exceed 1e-3 without
any bug (lr 1e-3 on 128 sequences drifts to ~3e-3 by step 200).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def tiny_config(dtype_name: str):
    from transformers import GptOssConfig

    return GptOssConfig(
        num_hidden_layers=2, hidden_size=256, intermediate_size=256,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
        attn_implementation="eager",
    )


def train(model, data, steps: int, batch: int, lr: float, device: torch.device) -> tuple[list[float], int | None]:
    """AdamW on fixed random sequences; returns the loss per step and the CUDA peak memory (bytes)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    n = data.shape[0]
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % n
        ids = data[idx].to(device)
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, peak


def plot(losses: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in losses.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, linestyle={"flashsink": "-", "eager": "--"}.get(name, ":"))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny gpt-oss on random tokens: flashsink vs eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu", help="cpu (reference path) or cuda (TileLang kernels)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=48, help="sequence length (> the window of 16)")
    p.add_argument("--sequences", type=int, default=64, help="size of the fixed random data set")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=20, help="print the curves every N steps")
    p.add_argument("--rtol", type=float, default=None,
                   help="fp32: max relative loss difference (default 1e-3); bf16/fp16: the margin added to twice eager's "
                        "distance to the fp32 curve (default one ulp: 2^-7 bf16, 2^-10 fp16)")
    p.add_argument("--precision", choices=["fast", "strict"], default="fast",
                   help="flashsink's precision mode (CUDA; default fast, as flashsink.attention); picks the bf16/fp16 "
                        "criterion's factor: 2 (strict, gate 2) or 4 (fast, the fast gate's element guard)")
    p.add_argument("--plot", default="train_gptoss_tiny.png", help="PNG path ('' for none)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")

    try:
        from transformers import GptOssForCausalLM

        from flashsink.integrations.transformers import NAME as SINK_ATTENTION  # registers "sink_attention"
        from flashsink.testing import FAST_MAX_FACTOR, GATE2_FACTOR
    except ImportError as err:
        print(f"this example needs Hugging Face transformers: pip install 'flashsink[hf]' ({err})", file=sys.stderr)
        return 2

    device = torch.device(args.device)
    dtype_name = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    lowp = dtype != torch.float32
    ulp = {torch.float32: 1e-3, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 1e-3)
    rtol = args.rtol if args.rtol is not None else ulp
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 matmuls outside attention
        torch.backends.cudnn.allow_tf32 = False

    torch.manual_seed(args.seed)
    init = GptOssForCausalLM(tiny_config(dtype_name)).to(dtype)
    g = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(3, 128, (args.sequences, args.seq), generator=g)

    losses, peaks, secs = {}, {}, {}
    runs = [("flashsink", SINK_ATTENTION, dtype), ("eager", "eager", dtype)]
    if lowp:
        runs.append(("eager fp32", "eager", torch.float32))  # the reference curve, same rounded start
    for label, impl, run_dtype in runs:
        print(f"training with {label} ({args.steps} steps)...", flush=True)
        model = copy.deepcopy(init).to(device=device, dtype=run_dtype)
        model.config._attn_implementation = impl
        model.config.flashsink_precision = args.precision  # read by the flashsink attention only
        torch.manual_seed(args.seed + 2)
        t0 = time.perf_counter()
        losses[label], peaks[label] = train(model, data, args.steps, args.batch, args.lr, device)
        secs[label] = time.perf_counter() - t0
        del model

    fs, ea = losses["flashsink"], losses["eager"]
    ref = losses["eager fp32"] if lowp else ea

    def rel_to(xs, ys):
        return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(xs, ys)]

    rel = rel_to(fs, ea)
    print(f"tiny gpt-oss, {device.type}, {dtype_name}, precision {args.precision}, batch {args.batch} x seq {args.seq}, "
          f"{args.steps} steps")
    extra = f" {'eager fp32':>12}" if lowp else ""
    print(f"{'step':>6} {'flashsink':>12} {'eager':>12}{extra} {'rel diff':>10}")
    shown = sorted({0, *range(args.every - 1, args.steps, args.every), args.steps - 1})
    for i in shown:
        extra = f" {ref[i]:>12.6f}" if lowp else ""
        print(f"{i + 1:>6} {fs[i]:>12.6f} {ea[i]:>12.6f}{extra} {rel[i]:>10.2e}")
    for label, _, _ in runs:
        mem = f"peak memory {peaks[label] / 2**20:.1f} MiB" if peaks[label] is not None else "peak memory: CUDA only"
        print(f"{label:>10}: {secs[label]:.1f} s, {mem}")
    worst = max(range(len(rel)), key=rel.__getitem__)
    print(f"max relative loss difference flashsink vs eager {rel[worst]:.2e} at step {worst + 1}")
    if lowp:
        fs_ref, ea_ref = max(rel_to(fs, ref)), max(rel_to(ea, ref))
        factor = FAST_MAX_FACTOR if args.precision == "fast" else GATE2_FACTOR
        limit = factor * ea_ref + rtol
        print(f"largest relative distance to the fp32 curve: flashsink {fs_ref:.2e}, eager {ea_ref:.2e} "
              f"(limit {factor:g} * eager + {rtol:.2e} = {limit:.2e}, precision {args.precision})")
        ok = fs_ref <= limit
    else:
        print(f"(limit {rtol:.0e})")
        ok = rel[worst] <= rtol
    if args.plot:
        plot(losses, args.plot)
    if not ok:
        print("FAIL: the flashsink and eager loss curves differ", file=sys.stderr)
        return 1
    print("OK: the loss curves agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
