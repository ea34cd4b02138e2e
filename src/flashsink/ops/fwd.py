"""Fused forward: ``o = softmax([q.k * scale, sink]) @ [v, 0]`` and the natural-log LSE.

One program per (query tile, query head, sequence). K/V tiles are read per KV head
(``head // groups``), never expanded. Batch, sequence lengths, window and scale are
runtime values; for packed varlen batches (layout ``thd``) so are ``cu_seqlens`` and the
longest sequence, which sizes the grid (tiles past the end of a shorter sequence visit no
keys and store nothing).
"""


import tilelang.language as T

from . import softmax
from .block_range import kv_blocks_for_rows
from .config import KernelConfig, fwd_tiles
from .layout import (kernel, prologue_load, qkv_shapes, seq_count, seq_tiles, sequence, stat_shape, store_rows, store_stat,
                     tile, varlen_params)
from .mask import visible


def build_fwd(cfg: KernelConfig):
    t = fwd_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    batch, heads, seq_q, seq_kv, rows_pad = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad")
    heads_kv = heads // groups
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v)
    lse_shape = stat_shape(layout, batch, heads, rows_pad)

    @T.macro
    def body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, m_tiles, n_seqs):
        with T.Kernel(m_tiles, heads, n_seqs, threads=t.threads) as (bx, head, b):
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

            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            row0 = bx * bm
            kv_head = head // groups
            lo, hi = kv_blocks_for_rows(row0, bm, bn, sq, sk, window, cfg.causal)
            # Load Q only for a tile that visits keys: a bulk copy left in flight by a program
            # that exits (no keys to visit) lands in shared memory reused by the epilogue or
            # by the next program on the SM.
            if lo < hi:
                T.copy(tile(Q, layout, b, head, q_base + row0, bm), q_s, prefer_instruction=prologue_load(cfg))
            T.fill(acc_o, 0)
            softmax.init_state(m, l, Sinks, head, bm, cfg.has_sinks)

            for kb in T.Pipelined(lo, hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, bn):
                    acc_s[i, j] = T.if_then_else(
                        visible(row0 + i, key0 + j, sq, sk, window, cfg.causal),
                        acc_s[i, j] * scale_log2,
                        -T.infinity(accum),
                    )
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s)
                softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v)
                T.copy(acc_s, p)
                T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            T.copy(acc_o, o_s)
            store_rows(O, layout, b, head, q_base, row0, sq, o_s, bm, dim_v)
            store_stat(LSE, layout, b, head, q_base, row0, sq, lse, bm)

    cu, longest, n_cu = varlen_params(layout)

    @kernel("flashsink_fwd", layout)
    def flashsink_fwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        Sinks: T.Tensor([heads], accum),
        CuQ: cu,
        CuK: cu,
        max_seqlen_q: longest,
        window: T.int32,
        scale_log2: T.float32,
        O: T.Tensor(o_shape, dtype),
        LSE: T.Tensor(lse_shape, accum),
    ):
        body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, seq_tiles(layout, max_seqlen_q, seq_q, bm),
             seq_count(layout, n_cu, batch))

    return flashsink_fwd
