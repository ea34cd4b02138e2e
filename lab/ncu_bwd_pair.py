"""One eager fwd+bwd of the library or of FlashAttention-4 inside a profiler range, after a warm-up call, for
ncu to read every kernel of it (the backward's preprocess, main kernel and postprocesses included):

    ncu --profile-from-start off --clock-control none --metrics ... python lab/ncu_bwd_pair.py flashsink
    ncu --profile-from-start off --clock-control none --metrics ... python lab/ncu_bwd_pair.py fa4

``NCU_SHAPE`` B,H,HKV,N,D[,W] (default 1,64,8,4096,128: issue 55's causal bf16 D128 problem). Both systems
take the same seeded [B, S, H, D] inputs with a learnable sink; lab/ncu_table.py turns ncu's CSV into the
rows of issue 55's table. lab/gpu_bwd_traffic.sh runs it beside the variants' timings.
"""

import math
import os
import sys

import torch


def main() -> int:
    system = sys.argv[1] if len(sys.argv) > 1 else "flashsink"
    if system not in ("flashsink", "fa4"):
        print(f"system must be flashsink or fa4, got {system!r}", file=sys.stderr)
        return 2
    b, h, hkv, n, d, *w = (int(x) for x in os.environ.get("NCU_SHAPE", "1,64,8,4096,128").split(","))
    window = w[0] if w else None
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, hh, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for hh in (h, hkv, hkv))
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(h, device="cuda", dtype=torch.float32, requires_grad=True)
    scale = 1 / math.sqrt(d)
    if system == "flashsink":
        import flashsink

        def call():
            return flashsink.attention(q, k, v, sinks, window=window, scale=scale, layout="bshd")
    else:
        from flash_attn.cute.interface import flash_attn_func

        kw = {"window_size": (window - 1, 0)} if window else {}

        def call():
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, learnable_sink=sinks, **kw)
            return out[0] if isinstance(out, (tuple, list)) else out

    call().backward(do)  # compiles and warms up, outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call().backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{system}: one fwd+bwd profiled, shape {b},{h},{hkv},{n},{d}" + (f",{window}" if window else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
