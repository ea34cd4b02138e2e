"""Fused forward: ``o = softmax([q.k * scale, sink]) @ [v, 0]`` and the natural-log LSE.

One program per (query tile, query head, sequence). K/V tiles are read per KV head
(``head // groups``), never expanded. Batch, sequence lengths, window and scale are
runtime values; for packed varlen batches (layout ``thd``) so is ``cu_seqlens``, and the
programs are the query tiles that exist (``schedule.py``).
"""


import tilelang.language as T

from . import softmax
from .block_range import full_kv_blocks_for_rows, kv_blocks_for_rows
from .config import (
    FWD_MASK_LIMITS, FWD_PIN_WAIT, KernelConfig, Tiles, fwd_fold, fwd_mask, fwd_o32_tiles, fwd_tiles,
    fwd_window_tiles, fwd_windowed, fwd_ws, fwd_ws_options,
)
from .fwd_entry import fwd_entry, fwd_shapes
from .fwd_ws import build_fwd_ws
from .layout import prologue_load, sequence, store_rows, store_stat, tile
from .mask import branch_logits, mask_logits, scale_logits
from .schedule import locate


#: ``mask=`` values of :func:`build_fwd`
FWD_MASKS = ("select", "split", "flag", "branch")


def build_fwd_unfolded(cfg: KernelConfig):
    """The forward without the scale folded into the exponent (``config.fwd_fold``): the kind a
    call with ``scale <= 0`` launches where the forward folds it."""
    return build_fwd(cfg, fold_scale=False)


def build_fwd_o32(cfg: KernelConfig):
    """Strict's forward when a backward follows (``config.fwd_o32``): two-term P @ V, and the output
    also in fp32 (``fwd_ws.build_fwd_ws``'s ``o32``) for the backward's Delta."""
    return build_fwd_ws(cfg, fwd_o32_tiles(cfg), fold=True, o32=True, pin_wait=FWD_PIN_WAIT,
                        mask_limits=FWD_MASK_LIMITS)


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


def build_fwd(cfg: KernelConfig, tiles: Tiles | None = None, mask: str | None = None, fold_scale: bool | None = None,
              ws: bool | None = None):
    """The forward. The options default to the library's kernel and exist for tools/fwd_variants.py,
    which times alternatives: ``tiles`` (``fwd_tiles(cfg)``); ``mask`` (``fwd_mask(cfg)``), how the mask is applied:
    ``"select"`` per element on every KV tile; ``"split"``, the key loop split into two
    pipelined loops, the wholly visible interior without a mask, then the diagonal and a
    window's leading edge with it; ``"flag"``, one loop whose select ORs a per-tile "wholly
    visible" scalar into the mask (``block_range.full_kv_blocks_for_rows`` says which tiles are);
    ``"branch"``, one loop that branches on that scalar around the select (registers only: the
    backward's per-tile branch failed ThreadSync, docs/perf-log.md v5, with shared memory inside);
    ``fold_scale``, the logits kept unscaled until the exponent, where the scale folds into one
    FMA as in TileLang's flash-attention examples (``softmax.update``). ``fold_scale`` needs
    ``scale > 0``: the running maximum is taken over the unscaled logits.

    ``ws`` (default ``config.fwd_ws(cfg)``, unless a ``mask`` other than ``"branch"`` or
    ``fold_scale=True`` asks for the pipelined kernel's options): ``fwd_ws.py``'s hand warp-specialized
    Hopper kernel (its mask is always ``"branch"``; its scale folded where ``config.fwd_fold(cfg)``,
    unless ``fold_scale=False``: the kind ``fwd_unfolded``, for a scale <= 0; its epilogue, Q slots and GQA packing
    ``config.fwd_ws_options(cfg, tiles)``).
    """
    if ws is None:
        ws = fwd_ws(cfg) and mask in (None, "branch") and not fold_scale
    if ws:
        if mask not in (None, "branch"):
            raise ValueError(f"the warp-specialized forward masks with 'branch'; got mask={mask!r}")
        fold = fwd_fold(cfg) if fold_scale is None else fold_scale
        t = tiles or fwd_tiles(cfg)
        return build_fwd_ws(cfg, t, fold=fold, **fwd_ws_options(cfg, t))
    fold_scale = bool(fold_scale)
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
            full = None  # (flo, fhi): the wholly visible KV blocks, for every mask but "select"
            if mask != "select":
                flo, fhi = full_kv_blocks_for_rows(lo, hi, row0, bm, bn, sq, sk, window, cfg.causal)
                full = (flo, fhi)  # bound once per tile, not re-evaluated per element
            # the key loops: (start, end, masked, K buffer, V buffer, block of the loop index, stages)
            loops = [(lo, hi, True, k_s, v_s, None, t.stages)]
            if mask == "split":
                # Two loops: the interior, then the masked blocks (the diagonal, then a window's
                # leading edge; the order changes the result by rounding only). TileLang pipelines
                # a buffer in one loop only, so the second loop has K/V tiles of its own, and one
                # stage: with two, its remapped block index fails TileLang 0.1.15's pipelining
                # ("Downcast from tirx.Sub to ir.IntImm failed"). A third loop for the leading edge
                # (key order) failed its ThreadSync ("Cannot match type int32 vs handle").
                k_s1 = T.alloc_shared([bn, dim], dtype)
                v_s1 = T.alloc_shared([bn, dim_v], dtype)
                n_diag = hi - fhi
                loops = [(flo, fhi, False, k_s, v_s, None, t.stages),
                         (0, n_diag + flo - lo, True, k_s1, v_s1, (fhi, n_diag, lo), 1)]

            for r in loops:
                for kb in T.Pipelined(r[0], r[1], num_stages=r[6]):
                    key0 = _block_of(kb, r[5]) * bn
                    T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), r[3])
                    T.clear(acc_s)
                    T.gemm(q_s, r[3], acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if mask == "branch":
                        branch_logits(acc_s, row0, key0, sq, sk, window, scale_log2, fold_scale, full, kb, cfg.causal)
                    elif r[2]:
                        mask_logits(acc_s, row0, key0, sq, sk, window, scale_log2, fold_scale,
                                    full if mask == "flag" else None, kb, cfg.causal)
                    else:
                        scale_logits(acc_s, scale_log2, fold_scale)
                    T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), r[4])
                    softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v,
                                   scale_log2 if fold_scale else None)
                    T.copy(acc_s, p)
                    T.gemm(p, r[4], acc_o, policy=T.GemmWarpPolicy.FullRow)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            T.copy(acc_o, o_s)
            store_rows(O, layout, b, head, q_base, row0, sq, o_s, bm, dim_v)
            store_stat(LSE, layout, b, head, q_base, row0, sq, lse, bm)

    return fwd_entry(cfg, shapes, body, bm)



def _block_of(i, remap):
    """The KV block of masked-loop index ``i``: ``(fhi, n_diag, lo)`` runs the diagonal blocks
    ``fhi ..`` first, then the leading edge ``lo ..``; ``None``: ``i`` itself."""
    if remap is None:
        return i
    fhi, n_diag, lo = remap
    return T.if_then_else(i < n_diag, fhi + i, lo + i - n_diag)
