"""Seconds from a configuration's first ``flashsink.attention`` call to its gradients, caches empty.

    source .gpu/setup.sh && python lab/first_use.py [--precision fast] [--problem gptoss-swa]

Issue 14 asks for at most 20 s of compilation at the first use of a configuration. This points
TileLang's and flashsink's kernel caches at fresh temporary directories (set before anything
imports tilelang), then times one eager fwd+bwd of the problem (the kernels the configuration
launches are built in parallel worker processes on that call, ``registry.get_kernel``), then a
second call of the same configuration at another length (must compile nothing: lengths are runtime
values). Prints one line per call.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

PROBLEMS = {
    # name: B, H, H_kv, N, D, window, dtype
    "gptoss-swa": (1, 64, 8, 4096, 64, 128, "bfloat16"),
    "gptoss-full": (1, 64, 8, 4096, 64, None, "bfloat16"),
    "golden": (1, 64, 8, 4096, 128, 128, "float16"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", default="gptoss-swa", choices=sorted(PROBLEMS))
    ap.add_argument("--precision", default="fast", choices=("fast", "strict"))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="flashsink-first-use-")
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(root, "tilelang")
    os.environ["FLASHSINK_CACHE_DIR"] = os.path.join(root, "flashsink")

    import torch

    import flashsink

    b, h, hk, n, d, window, dt = PROBLEMS[args.problem]
    dtype = getattr(torch, dt)
    torch.cuda.init()
    for i, length in enumerate((n, n // 2 + 3)):
        g = torch.Generator(device="cuda").manual_seed(i)
        q, k, v = (torch.randn(b, heads, length, d, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
                   for heads in (h, hk, hk))
        sinks = torch.randn(h, device="cuda", generator=g).requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = flashsink.attention(q, k, v, sinks, window=window, precision=args.precision)
        o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        what = "first use (caches empty)" if i == 0 else "same configuration, another length"
        print(f"{args.problem} {args.precision} N={length}: {what}: {secs:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
