"""Split-KV forward kernel: the query rows of every head of a GQA group packed into one tile,
the visible KV blocks split over ``n_splits`` programs, each writing a partial output (fp32)
and its LSE without the sink. ``decode.py`` decides when to use it and merges the partials.

Only the key tiles that some query row does not see whole (the rows' last keys, a window's leading
edge) take the per-element mask; the others are only scaled (``block_range.full_kv_blocks_for_rows``,
one branch a tile: ``mask.branch_tile``, as in the backward).
"""

import tilelang.language as T

from ..tir import softmax
from ..tir.block_range import full_kv_blocks_for_rows, kv_blocks_for_rows, split_blocks
from ...kernel_config import KernelConfig, split_tiles
from ..tir.layout import HeadMajor, index, qkv_shapes, tile
from ..tir.mask import branch_tile, in_blocks, packed_logits


def build_fwd_split(cfg: KernelConfig):
    """The kernel (the module's docstring), over ``config.split_tiles``."""
    t = split_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    batch, heads, seq_q, seq_kv, n_splits = T.dynamic("batch, heads, seq_q, seq_kv, n_splits")
    heads_kv = heads // groups
    q_shape, k_shape, v_shape, _ = qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v)

    @T.prim_func
    def flashsink_fwd_split(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        window: T.int32,
        scale_log2: T.float32,
        OPart: T.Tensor([batch, heads, seq_q, n_splits, dim_v], accum),
        LSEPart: T.Tensor([batch, heads, seq_q, n_splits], accum),
    ):
        with T.Kernel(n_splits, heads_kv, batch, threads=t.threads) as (split, kv_head, b):
            q_s, k_s, v_s, acc_s, p, acc_o = alloc_tiles(bm, bn, dim, dim_v, dtype)
            m, m_prev, alpha, row_sum, l, lse = softmax.alloc_state(bm)

            n_rows = groups * seq_q  # packed row p is query row p % seq_q of head p // seq_q
            rows = HeadMajor(n_rows, seq_q)
            # (no Python names for per-element expressions inside T.Parallel: a name becomes a
            # Let binding, which the sm_80 code generator refuses to see bound twice)
            for r, d in T.Parallel(bm, dim):
                q_s[r, d] = T.if_then_else(
                    r < n_rows, Q[index(layout, b, kv_head * groups + r // seq_q, r % seq_q, d)], T.cast(0, dtype)
                )
            T.fill(acc_o, 0)
            softmax.init_state(m, l, None, 0, bm, False)
            lo, hi = kv_blocks_for_rows(0, bm, bn, seq_q, seq_kv, window, cfg.causal)
            # the wholly visible KV blocks of every query row (all of them are in the tile): no per-element mask
            # there, only the scale. Rows past the group's (q zero) then keep finite logits instead of -inf;
            # they are never stored, and a softmax row never mixes with another.
            full = full_kv_blocks_for_rows(lo, hi, 0, seq_q, bn, seq_q, seq_kv, window, cfg.causal)
            my_lo, my_hi = split_blocks(lo, hi, (split, n_splits))

            for kb in T.Pipelined(my_lo, my_hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, layout, b, kv_head, key0, bn), k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                branch_tile(packed_logits, in_blocks(kb, full), acc_s, rows, key0, seq_q, seq_kv, window, scale_log2,
                            cfg.causal)
                T.copy(tile(V, layout, b, kv_head, key0, bn), v_s)
                softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v)
                T.copy(acc_s, p)
                T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            for r, d in T.Parallel(bm, dim_v):
                if r < n_rows:
                    OPart[b, kv_head * groups + r // seq_q, r % seq_q, split, d] = acc_o[r, d]
            for r in T.Parallel(bm):
                if r < n_rows:
                    LSEPart[b, kv_head * groups + r // seq_q, r % seq_q, split] = lse[r]

    return flashsink_fwd_split


def alloc_tiles(bm: int, bn: int, dim: int, dim_v: int, dtype: str) -> tuple:
    """The split forwards' tiles (this kernel's and ``fwd_kvcache``'s), in this order: ``(q_s, k_s, v_s,
    acc_s, p, acc_o)``, the kernel naming them by the names it unpacks them into."""
    return (T.alloc_shared([bm, dim], dtype), T.alloc_shared([bn, dim], dtype), T.alloc_shared([bn, dim_v], dtype),
            T.alloc_fragment([bm, bn], "float32"), T.alloc_fragment([bm, bn], dtype),
            T.alloc_fragment([bm, dim_v], "float32"))
