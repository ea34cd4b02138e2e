"""One problem's eager fwd+bwd, twice (the first compiles and warms up), for a profiler to attach to:

    ncu -k "regex:flashsink_(fwd|bwd)_kernel" --launch-skip 2 --launch-count 2 python lab/ncu_target.py

``NCU_SHAPE`` B,H,HKV,N,D[,W] (default 1,64,8,8192,64: causal bf16 gpt-oss full attention at N=8192)."""

import os

import torch

import flashsink


def main() -> None:
    b, h, hkv, n, d, *w = (int(x) for x in os.environ.get("NCU_SHAPE", "1,64,8,8192,64").split(","))
    torch.manual_seed(0)
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(h, device="cuda", dtype=torch.float32, requires_grad=True)
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        o = flashsink.attention(q, k, v, sinks, window=w[0] if w else None, layout="bshd")
        o.backward(do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
