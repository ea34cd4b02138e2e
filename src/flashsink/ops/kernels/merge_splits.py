"""Merge split-KV partials and apply the sink once: one small kernel after a split-KV forward.

Per (batch, head, query row), with ``S`` partials ``(o_s, lse_s)`` (fp32, LSE natural log and
without the sink) and the head's sink ``sigma`` (when the config has sinks)::

    lse = log(sum_s exp(lse_s) + exp(sigma))
    o   = sum_s exp(lse_s - lse) o_s

the algebra of :func:`flashsink.combine.merge_stacked`, with its conventions: a partial with
``lse_s = -inf`` (a split that saw no key) is ignored whatever its o holds; a row with no term at
all gets o = 0 and lse = -inf; the pivot is 0 where the largest term is not finite (a +inf sink
gives o = 0, lse = +inf); a NaN term makes the row NaN. Writes o in ``cfg.layout`` ("bhsd" or
"bshd") and the input dtype, and lse into ``[B, H, rows_pad]`` (rows past ``seq_q`` untouched).
One program per (query row, head, batch), ``dim_v`` threads wide.
"""

import tilelang.language as T

from ...kernel_config import LOG2E, KernelConfig
from ..tir.layout import index, padded_shape

LN2 = 0.6931471805599453


def build_merge_splits(cfg: KernelConfig):
    dim_v, dtype, accum, layout = cfg.head_dim_v, cfg.dtype, "float32", cfg.layout
    batch, heads, seq_q, n_splits, rows_pad = T.dynamic("batch, heads, seq_q, n_splits, rows_pad")
    o_shape = padded_shape(layout, batch, heads, seq_q, dim_v)

    @T.prim_func
    def flashsink_merge_splits(
        OPart: T.Tensor([batch, heads, seq_q, n_splits, dim_v], accum),
        LSEPart: T.Tensor([batch, heads, seq_q, n_splits], accum),
        Sinks: T.Tensor([heads], accum),
        O: T.Tensor(o_shape, dtype),
        LSE: T.Tensor([batch, heads, rows_pad], accum),
    ):
        with T.Kernel(seq_q, heads, batch, threads=min(dim_v, 128)) as (r, h, b):
            acc = T.alloc_fragment([dim_v], accum)
            top = T.alloc_local([1], accum)  # largest term, base 2
            pivot = T.alloc_local([1], accum)
            den = T.alloc_local([1], accum)
            w = T.alloc_local([1], accum)
            x = T.alloc_local([1], accum)

            top[0] = Sinks[h] * LOG2E if cfg.has_sinks else -T.infinity(accum)
            for s in T.serial(n_splits):
                top[0] = T.max(top[0], LSEPart[b, h, r, s] * LOG2E)
            finite = (top[0] > -T.infinity(accum)) & (top[0] < T.infinity(accum))
            pivot[0] = T.if_then_else(finite, top[0], 0.0)
            den[0] = T.exp2(Sinks[h] * LOG2E - pivot[0]) if cfg.has_sinks else 0.0
            T.fill(acc, 0)
            for s in T.serial(n_splits):
                x[0] = LSEPart[b, h, r, s]
                w[0] = T.exp2(x[0] * LOG2E - pivot[0])  # -inf: 0; NaN: NaN
                den[0] += w[0]
                for d in T.Parallel(dim_v):
                    # a split with no key (lse -inf) holds no value: skip its o (may be NaN)
                    acc[d] += T.if_then_else(x[0] == -T.infinity(accum), 0.0, w[0] * OPart[b, h, r, s, d])
            for d in T.Parallel(dim_v):
                O[index(layout, b, h, r, d)] = T.cast(T.if_then_else(den[0] == 0, 0.0, acc[d] / den[0]), dtype)
            # finite top: den >= 1; top +inf: den = inf and lse = +inf; no term: den = 0, lse = -inf
            LSE[b, h, r] = T.if_then_else(den[0] == 0, -T.infinity(accum),
                                          (pivot[0] + T.log2(den[0])) * LN2)

    return flashsink_merge_splits
