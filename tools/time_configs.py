"""Forward and forward+backward times of flashsink on the golden and gpt-oss configurations
(median of CUDA-event timings after warm-up, triton.testing.do_bench). The full benchmark
against peers is `flashsink bench`; this is the quick number for kernel work."""

import torch
from triton.testing import do_bench

import flashsink
from flashsink.testing import make_inputs

CONFIGS = [
    # name, B, H, H_kv, N, D, window, dtype
    ("golden", 1, 64, 8, 4096, 128, 128, torch.float16),
    ("gptoss-swa", 1, 64, 8, 4096, 64, 128, torch.bfloat16),
    ("gptoss-full-8k", 1, 64, 8, 8192, 64, None, torch.bfloat16),
    ("causal-d128-4k", 1, 32, 32, 4096, 128, None, torch.bfloat16),
]


def pairs(n, w):
    if w is None:
        return n * (n + 1) // 2
    return sum(min(i + 1, w) for i in range(n))


def main():
    print(f"{'config':<16} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9}")
    for name, b, h, hk, n, d, w, dt in CONFIGS:
        inp = make_inputs(b, h, hk, n, n, d, dt, "cuda")
        q, k, v = (inp[x].requires_grad_(True) for x in ("q", "k", "v"))
        s = inp["sinks"].requires_grad_(True)
        do = inp["do"]

        def fwd():
            with torch.no_grad():
                flashsink.attention(q, k, v, s, window=w)

        def fwd_bwd():
            o = flashsink.attention(q, k, v, s, window=w)
            torch.autograd.grad(o, (q, k, v, s), do)

        fwd(), fwd_bwd()
        t_f = do_bench(fwd, warmup=50, rep=300, return_mode="median")
        t_fb = do_bench(fwd_bwd, warmup=50, rep=300, return_mode="median")
        p = b * h * pairs(n, w)
        fl_f, fl_fb = 4 * p * d, 14 * p * d
        print(f"{name:<16} {t_f:8.3f} {fl_f / t_f / 1e9:9.1f} {t_fb:8.3f} {fl_fb / t_fb / 1e9:9.1f}")


if __name__ == "__main__":
    main()
