"""Two-term products: ``A @ B`` with an fp32 ``A`` fed to the tensor cores as ``hi + lo``.

The tensor cores take fp16/bf16 operands. Rounding an fp32 tile (P, dS) to the input
dtype costs a relative 2^-11 (fp16) or 2^-8 (bf16) per element, which is what keeps
dK, dV and dQ from the precision standard's 99%-within-tolerance gate (measured: 97.8%
of dV elements, golden problem, fp16). Splitting ``A = hi + lo`` with
``hi = round(A)``, ``lo = round(A - hi)`` and accumulating both products in fp32
recovers ~22 (fp16) / ~16 (bf16) bits at the cost of one more MMA per product; the
``lo`` term of fp16 may be subnormal, whose absolute spacing (2^-24) is still far
below the tolerance. This is the seed's "compensated GEMM", done in registers.
"""

import tilelang.language as T


@T.macro
def split(x, hi, lo, rows: int, cols: int):
    """``hi = round(x)``, ``lo = round(x - hi)`` elementwise (fragments of one layout)."""
    T.copy(x, hi)
    for i, j in T.Parallel(rows, cols):
        lo[i, j] = x[i, j] - hi[i, j]
