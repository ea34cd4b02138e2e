"""The library's forward and FlashAttention-4's on one problem, each run three times (the first compiles), for
a profiler to attach to and compare the two kernels side by side:

    ncu -k "regex:flashsink_fwd|FlashAttentionForward" --launch-count 6 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \\
        python lab/ncu_fwd_pair.py

(six launches: the library's three, then FA4's three; FA4's kernel is named
``kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_...``).

``NCU_SHAPE`` B,H,HKV,N,D[,W] (default 1,64,8,4096,128: causal bf16 D128, where the library's forward is
0.90x FA4's, docs/perf-log.md v22). FA4 must be importable (``source .fa4/setup.sh`` on the GPU host); without
it only the library's forward runs, and the script says so. The two outputs are checked against each other
(bf16 relative L2), so a profile of a wrong kernel does not pass unnoticed.
"""

import math
import os
import sys

import torch

import flashsink


def main() -> int:
    b, h, hkv, n, d, *w = (int(x) for x in os.environ.get("NCU_SHAPE", "1,64,8,4096,128").split(","))
    window = w[0] if w else None
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, hh, d, device="cuda", dtype=torch.bfloat16) for hh in (h, hkv, hkv))
    sinks = torch.randn(h, device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(d)
    outs = {}
    for _ in range(3):
        outs["flashsink"] = flashsink.attention(q, k, v, sinks, window=window, scale=scale, layout="bshd")
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError as exc:
        print(f"FA4 not importable ({exc}); only the library's forward ran", file=sys.stderr)
    else:
        kw = {"window_size": (window - 1, 0)} if window else {}
        for _ in range(3):
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, learnable_sink=sinks, **kw)
            outs["fa4"] = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    if "fa4" in outs:
        a, r = outs["flashsink"].double(), outs["fa4"].double()
        print(f"flashsink against FA4: relative L2 {float((a - r).norm() / r.norm()):.2e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
