"""The sha256 of every kernel's TIR over a grid of configurations: a refactor that should not change
the generated kernels must leave every line of the output unchanged.

    python tools/tir_hashes.py -o /tmp/before.txt     # on the old tree
    python tools/tir_hashes.py -o /tmp/after.txt      # on the new one
    diff /tmp/before.txt /tmp/after.txt               # no output: the kernels are unchanged
    python tools/tir_hashes.py --shapes 0,4 --kinds fwd,bwd --arch sm_90a -o x.txt   # a targeted check

Lowering input only (``build_prim_func(kind, cfg).script(show_meta=True)``): no nvcc, no GPU.
A kind that does not build for a configuration prints the exception's type instead of a hash, so a
refactor that makes a kind build (or fail) where it did not is a changed line too.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools

from flashsink.ops.compiler.compile import build_prim_func
from flashsink.kernel_config import KernelConfig
from flashsink.ops.compiler.kinds import KINDS


#: (dtype, head_dim, head_dim_v, groups, sinks): the grid's shapes (the first four by default, as before
#: --shapes existed, so that outputs of older trees compare line for line); the last is gpt-oss's
SHAPES = [("bfloat16", 128, 128, 8, True), ("float16", 64, 64, 1, False), ("bfloat16", 256, 256, 2, True),
          ("bfloat16", 128, 64, 4, True), ("bfloat16", 64, 64, 8, True)]
DEFAULT_SHAPES = 4


def configs(quick: bool = False, shapes=None, archs=("sm_90a", "sm_80")):
    """sm_90a and sm_80, every layout, causal and full, fast / strict, deterministic or not, with a
    few head dims, GQA ratios and sinks on and off. ``quick``: the first shape only; ``shapes``:
    indices into :data:`SHAPES` instead."""
    modes = [("fast", False), ("strict", False), ("strict", True), ("fast", True)]
    chosen = [SHAPES[i] for i in shapes] if shapes is not None else SHAPES[:1] if quick else SHAPES[:DEFAULT_SHAPES]
    for arch, layout, causal, (prec, det) in itertools.product(
            archs, ("bhsd", "bshd", "thd"), (True, False), modes):
        for dtype, d, dv, g, sinks in chosen:
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
    p.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (e.g. 0,4: D128 GQA 8 and "
                                                  "gpt-oss's D64), instead of --quick's or all")
    p.add_argument("--kinds", default=None, help="comma-separated kernel kinds (default: every kind of KINDS)")
    p.add_argument("--arch", default=None, help="sm_90a or sm_80 only (default: both)")
    p.add_argument("-o", "--out", required=True, help="file for the hashes (TileLang logs its build failures to stdout)")
    args = p.parse_args(argv)
    kinds = list(KINDS) if args.kinds is None else args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {list(KINDS)}")
    shapes = None if args.shapes is None else [int(i) for i in args.shapes.split(",")]
    archs = ("sm_90a", "sm_80") if args.arch is None else (args.arch,)
    with open(args.out, "w") as out:
        for cfg in configs(args.quick, shapes, archs):
            for kind in kinds:
                print(f"{kind:<13} {cfg.short():<64} {tir_hash(kind, cfg)}", file=out, flush=True)


if __name__ == "__main__":
    main()
