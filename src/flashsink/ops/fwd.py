"""Fused forward: ``o = softmax([q.k * scale, sink]) @ [v, 0]`` and the natural-log LSE.

One program per (query tile, query head, batch). K/V tiles are read per KV head
(``head // groups``), never expanded. Batch, sequence lengths, window and scale are
runtime values.
"""


import tilelang.language as T

from . import softmax
from .block_range import kv_blocks_for_rows
from .config import KernelConfig, fwd_tiles
from .layout import qkv_shapes, store_rows, tile
from .mask import visible

def build_fwd(cfg: KernelConfig):
    t = fwd_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups = cfg.head_dim, cfg.head_dim_v, cfg.groups
    dtype, accum = cfg.dtype, "float32"
    batch, heads, seq_q, seq_kv, rows_pad = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad")
    heads_kv = heads // groups
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(cfg.layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v)

    @T.prim_func
    def flashsink_fwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        Sinks: T.Tensor([heads], accum),
        window: T.int32,
        scale_log2: T.float32,
        O: T.Tensor(o_shape, dtype),
        LSE: T.Tensor([batch, heads, rows_pad], accum),
    ):
        with T.Kernel(T.ceildiv(seq_q, bm), heads, batch, threads=t.threads) as (bx, head, b):
            q_s = T.alloc_shared([bm, dim], dtype)
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            o_s = T.alloc_shared([bm, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)  # logits, then probabilities
            p = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            m = T.alloc_fragment([bm], accum)
            m_prev = T.alloc_fragment([bm], accum)
            alpha = T.alloc_fragment([bm], accum)
            row_sum = T.alloc_fragment([bm], accum)
            l = T.alloc_fragment([bm], accum)
            lse = T.alloc_fragment([bm], accum)

            row0 = bx * bm
            kv_head = head // groups
            T.copy(tile(Q, cfg.layout, b, head, row0, bm), q_s)
            T.fill(acc_o, 0)
            softmax.init_state(m, l, Sinks, head, bm, cfg.has_sinks)
            lo, hi = kv_blocks_for_rows(row0, bm, bn, seq_q, seq_kv, window, cfg.causal)

            for kb in T.Pipelined(lo, hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, cfg.layout, b, kv_head, key0, bn), k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    acc_s[i, j] = T.if_then_else(
                        visible(row0 + i, key0 + j, seq_q, seq_kv, window, cfg.causal),
                        acc_s[i, j] * scale_log2,
                        -T.infinity(accum),
                    )
                T.copy(tile(V, cfg.layout, b, kv_head, key0, bn), v_s)
                softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v)
                T.copy(acc_s, p)
                T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            T.copy(acc_o, o_s)
            store_rows(O, cfg.layout, b, head, row0, seq_q, o_s, bm, dim_v)
            T.copy(lse, LSE[b, head, row0 : row0 + bm])

    return flashsink_fwd

