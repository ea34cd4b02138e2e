"""The sha256 of every kernel's TIR over a grid of configurations: a refactor that should not change
the generated kernels must leave every line of the output unchanged.

    python tools/tir_hashes.py -o /tmp/before.txt     # on the old tree
    python tools/tir_hashes.py -o /tmp/after.txt      # on the new one
    diff /tmp/before.txt /tmp/after.txt               # no output: the kernels are unchanged

Lowering input only (``build_prim_func(kind, cfg).script(show_meta=True)``): no nvcc, no GPU.
A kind that does not build for a configuration prints the exception's type instead of a hash, so a
refactor that makes a kind build (or fail) where it did not is a changed line too.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools

from flashsink.ops.compile import build_prim_func
from flashsink.ops.config import KernelConfig
from flashsink.ops.kinds import KINDS


def configs(quick: bool = False):
    """sm_90a and sm_80, every layout, causal and full, fast / strict, deterministic or not, with a
    few head dims, GQA ratios and sinks on and off."""
    shapes = [("bfloat16", 128, 128, 8, True), ("float16", 64, 64, 1, False), ("bfloat16", 256, 256, 2, True),
              ("bfloat16", 128, 64, 4, True)]
    modes = [("fast", False), ("strict", False), ("strict", True), ("fast", True)]
    for arch, layout, causal, (prec, det) in itertools.product(
            ("sm_90a", "sm_80"), ("bhsd", "bshd", "thd"), (True, False), modes):
        for dtype, d, dv, g, sinks in shapes[:1] if quick else shapes:
            yield KernelConfig(arch=arch, dtype=dtype, head_dim=d, head_dim_v=dv, groups=g, causal=causal,
                               has_sinks=sinks, layout=layout, deterministic=det, precision=prec)


def tir_hash(kind: str, cfg: KernelConfig) -> str:
    try:
        text = build_prim_func(kind, cfg).script(show_meta=True)
    except Exception as exc:  # a kind that does not build here: part of what must not change
        return f"error:{type(exc).__name__}"
    return hashlib.sha256(text.encode()).hexdigest()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape per (arch, layout, mask, mode)")
    p.add_argument("-o", "--out", required=True, help="file for the hashes (TileLang logs its build failures to stdout)")
    args = p.parse_args(argv)
    with open(args.out, "w") as out:
        for cfg in configs(args.quick):
            for kind in KINDS:
                print(f"{kind:<13} {cfg.short():<64} {tir_hash(kind, cfg)}", file=out, flush=True)


if __name__ == "__main__":
    main()
