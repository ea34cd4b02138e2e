"""Fused forward: ``o = softmax([q.k * scale, sink]) @ [v, 0]`` and the natural-log LSE.

:func:`build_fwd` is the library's forward: ``fwd_ws.py``'s hand warp-specialized kernel where
``config.fwd_ws`` says, else :func:`build_fwd_pipelined`, TileLang's pipelined kernel with one program
per (query tile, query head, sequence). K/V tiles are read per KV head (``head // groups``), never
expanded. Batch, sequence lengths, window and scale are runtime values; for packed varlen batches
(layout ``thd``) so is ``cu_seqlens``, and the programs are the query tiles that exist (``schedule.py``).
"""


import tilelang.language as T

from ..tir import softmax
from ..tir.block_range import full_kv_blocks_for_rows, kv_blocks_for_rows
from ...kernel_config import (
    KernelConfig, Tiles, fwd_fold, fwd_mask, fwd_o32_tiles, fwd_tiles, fwd_window_tiles, fwd_windowed, fwd_ws,
    fwd_ws_options,
)
from .fwd_entry import fwd_entry, fwd_shapes
from .fwd_ws import build_fwd_ws
from ..tir.layout import prologue_load, sequence, store_rows, store_stat, tile
from ..tir.mask import branch_logits, mask_logits
from ..tir.schedule import locate


#: ``mask=`` values of :func:`build_fwd_pipelined`
FWD_MASKS = ("select", "branch")


def build_fwd(cfg: KernelConfig):
    """The library's forward (the kind ``fwd``): ``fwd_ws.build_fwd_ws`` with ``config.fwd_tiles``, the
    scale folded where ``config.fwd_fold``, and ``config.fwd_ws_options``, where ``config.fwd_ws``;
    else :func:`build_fwd_pipelined`."""
    if fwd_ws(cfg):
        t = fwd_tiles(cfg)
        return build_fwd_ws(cfg, t, fold=fwd_fold(cfg), **fwd_ws_options(cfg, t))
    return build_fwd_pipelined(cfg)


def build_fwd_unfolded(cfg: KernelConfig):
    """The forward without the scale folded into the exponent (``config.fwd_fold``): the kind a
    call with ``scale <= 0`` launches where the forward folds it."""
    if fwd_ws(cfg):
        t = fwd_tiles(cfg)
        return build_fwd_ws(cfg, t, fold=False, **fwd_ws_options(cfg, t))
    return build_fwd_pipelined(cfg)


def build_fwd_o32(cfg: KernelConfig):
    """Strict's forward when a backward follows (``config.fwd_o32``): two-term P @ V, and the output
    also in fp32 (``fwd_ws.build_fwd_ws``'s ``o32``) for the backward's Delta."""
    return build_fwd_ws(cfg, fwd_o32_tiles(cfg), fold=True, o32=True)


def build_fwd_window(cfg: KernelConfig):
    """The forward with a narrow window's tiles (``config.fwd_window_tiles``: 64-key tiles, a GQA group
    packed into each), the kind a call with ``window <= config.WINDOW_TILES_MAX`` launches where those
    tiles differ from the forward's (``config.fwd_windowed``)."""
    if not fwd_windowed(cfg):
        raise NotImplementedError(
            "the windowed forward (kind fwd_window) builds on Hopper (sm_90a) for causal configurations with "
            "equal head dims 64, or 128 in padded layouts, whose GQA group packs into its row tiles "
            f"(config.pack_gqa_fits); got {cfg.short()}: its windows run the forward (kind fwd)")
    t = fwd_window_tiles(cfg)
    return build_fwd_ws(cfg, t, fold=fwd_fold(cfg), **fwd_ws_options(cfg, t, window=True))


def build_fwd_pipelined(cfg: KernelConfig, tiles: Tiles | None = None, mask: str | None = None):
    """TileLang's pipelined forward (``T.Pipelined`` over the key tiles) for ``tiles`` (default
    ``config.fwd_tiles``). ``mask`` (default ``config.fwd_mask``): ``"select"`` masks every KV tile per
    element; ``"branch"`` branches per tile around the select, which only the tiles that are not wholly
    visible (``block_range.full_kv_blocks_for_rows``) run."""
    mask = fwd_mask(cfg) if mask is None else mask
    if mask not in FWD_MASKS:
        raise ValueError(f"mask must be one of {FWD_MASKS}, got {mask!r}")
    t = tiles or fwd_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    shapes = fwd_shapes(cfg)
    heads, seq_q, seq_kv = shapes.heads, shapes.seq_q, shapes.seq_kv

    @T.macro
    def body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, m_tiles, n_seqs, O32=None):  # no O32: fwd_entry's None
        with T.Kernel(m_tiles, heads, n_seqs, threads=t.threads) as (bx, head, b):
            q_s = T.alloc_shared([bm, dim], dtype)
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            o_s = T.alloc_shared([bm, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)  # logits, then probabilities
            p = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            m, m_prev, alpha, row_sum, l, lse = softmax.alloc_state(bm)

            b, bx = locate(layout, CuQ, bx, b, bm)
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
            full = None  # (flo, fhi): the wholly visible KV blocks, for "branch"
            if mask != "select":
                flo, fhi = full_kv_blocks_for_rows(lo, hi, row0, bm, bn, sq, sk, window, cfg.causal)
                full = (flo, fhi)  # bound once per tile, not re-evaluated per element
            for kb in T.Pipelined(lo, hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if mask == "branch":
                    branch_logits(acc_s, row0, key0, sq, sk, window, scale_log2, False, full, kb, cfg.causal)
                else:
                    mask_logits(acc_s, row0, key0, sq, sk, window, scale_log2, False, cfg.causal)
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s)
                softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v)
                T.copy(acc_s, p)
                T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            T.copy(acc_o, o_s)
            store_rows(O, layout, b, head, q_base, row0, sq, o_s, bm, dim_v)
            store_stat(LSE, layout, b, head, q_base, row0, sq, lse, bm)

    return fwd_entry(cfg, shapes, body, bm)
