"""Backward: a preprocess, ONE main kernel for dQ/dK/dV, and a dQ cast.

With ``P = exp(S * scale - lse)`` (lse includes the sink) the gradients are
FlashAttention's::

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta) * scale
    dK = dS^T Q        dQ = dS K          Delta = rowsum(dO * O)

and the sink gets ``dsink[h] = -sum_rows exp(sink[h] - lse) * Delta``.

- ``build_preprocess``: Delta per row minus any gradient flowing into lse; and, in the same
  pass, the sink gradient (one fp32 atomic per program, or per-program partials summed in
  order when deterministic). Strict: Delta = ``rowsum(P * dP)`` recomputed in fp32 (see
  there why); fast: ``rowsum(dO * O)`` from the saved output, a memory-bound pass. Outside
  deterministic mode it also zeroes its rows of the fp32 dQ accumulator, so the host fills none.
- ``build_bwd``: KV-stationary. One program per (KV block, KV head, batch) keeps its K/V
  tile and its dK/dV accumulators on chip and streams the query tiles of *every* query
  head of its GQA group through them, recomputing P and dS from ``lse``: no GM
  workspace, no dK/dV atomics, no ``[B, H, N, D]`` fp32 buffers for dK/dV. dQ tiles
  are added in fp32 into a row-padded accumulator (atomics, onto the preprocess's zeros), or skipped when
  deterministic. Strict: the products with P and dS are two-term (``split.py``) so the
  gradients meet the precision standard (8 MMAs per tile); fast: P and dS are rounded
  once to the input dtype, as FlashAttention does (5 MMAs per tile).
- ``build_dq``: the deterministic dQ pass (query-stationary, no atomics).
- ``build_postprocess``: casts the fp32 dQ accumulator into dQ in the input layout.
"""

from types import SimpleNamespace

import tilelang.language as T

from ..tir.block_range import full_kv_blocks_for_rows, full_row_blocks_for_keys, kv_blocks_for_rows, row_blocks_for_keys
from .bwd_entry import main_bwd_entry, main_bwd_shapes
from .bwd_ws import build_bwd_ws
from ...kernel_config import (ROW_BLOCK, KernelConfig, bwd_branch, bwd_dq_bulk, bwd_dq_first, bwd_overlap, bwd_split,
                     bwd_swap, bwd_tiles, bwd_ws, dq_tiles, pre_branch, pre_lpt, pre_o32_tiles, pre_tiles)
from ..tir.layout import (acc_tile, clear_acc_rows, kernel, optional, prologue_load, qkv_shapes, row_runs, sequence, stage_stat,
                     staged_stat, stat_at, stat_shape, stat_tile, store_rows, store_stat, tile, varlen_params)
from ..tir.schedule import grid, grid_coords, grid_dims, locate
from ..tir.mask import branch_tile, in_blocks, select_visible, visible
from ..tir.softmax import LOG2E
from ..tir.split import split

@T.macro
def probs(p, lse, row0, key0, seq_q, seq_kv, window, scale_log2, causal: bool, masked: bool):
    """``p`` (the logits of a query tile x KV tile) to P from the rows' lse; ``masked``: selected to
    the visible pairs (an exact 0 elsewhere)."""
    for i, j in T.Parallel(p.shape[0], p.shape[1]):
        p[i, j] = select_visible(T.exp2(p[i, j] * scale_log2 - lse[i] * LOG2E), row0 + i, key0 + j, seq_q, seq_kv,
                                 window, causal, masked)


@T.macro
def probs_and_grads(q_s, do_s, k_s, v_s, lse, p, dp, row0, key0, seq_q, seq_kv, window, scale_log2, causal: bool,
                    full=None):
    """For a resident query tile and one KV tile: ``p = P`` (masked, from lse) and
    ``dp = dO V^T``, both ``[rows, keys]`` fp32 (preprocess and deterministic dQ). ``full``: a
    condition under which the KV tile is wholly visible to the query tile, so P skips the mask there
    (``mask.branch_tile``); None, the mask on every tile."""
    T.clear(p)
    T.gemm(q_s, k_s, p, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    T.clear(dp)
    T.gemm(do_s, v_s, dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    branch_tile(probs, full, p, lse, row0, key0, seq_q, seq_kv, window, scale_log2, causal)


@T.macro
def product(a, hi, lo, b_s, acc, rows: int, cols: int, fast: bool):
    """``acc += a @ b_s`` for an fp32 fragment ``a`` ``[rows, cols]``: rounded once to the input
    dtype (fast), or as the two-term ``hi + lo`` (strict, ``split.py``). ``hi`` keeps the
    rounded ``a`` afterwards (the dQ product reuses it)."""
    if fast:
        T.copy(a, hi)
        T.gemm(hi, b_s, acc, policy=T.GemmWarpPolicy.FullRow)
    else:
        split(a, hi, lo, rows, cols)
        T.gemm(hi, b_s, acc, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(lo, b_s, acc, policy=T.GemmWarpPolicy.FullRow)


def build_preprocess_o32(cfg: KernelConfig):
    """Strict's Delta = rowsum(dO * O) from the forward's fp32 O (``config.fwd_o32``) in the fast
    preprocess's memory-bound pass, instead of recomputing P and dP."""
    if cfg.precision != "strict":
        raise ValueError(f"preprocess_o32 is strict's Delta from the forward's fp32 O; got precision={cfg.precision!r}")
    return _build_preprocess_fast(cfg, "float32", pre_o32_tiles(cfg))


def build_preprocess(cfg: KernelConfig):
    """Delta and the sink gradient: from P and dP (strict, :func:`build_preprocess_strict` with
    ``config.pre_branch`` / ``pre_lpt`` / ``pre_tiles``) or from O and dO (fast)."""
    if cfg.precision == "fast":
        return _build_preprocess_fast(cfg, cfg.dtype, pre_tiles(cfg))
    return build_preprocess_strict(cfg, pre_tiles(cfg), pre_branch(cfg), pre_lpt(cfg))


@T.macro
def _store_delta(Delta, dLSE, LSE, Sinks, lse, delta, contrib, total, head, b, bx, q_base, row0, sq, dSinkAcc,
                 dSinkPart, cfg: KernelConfig, load_lse: bool):
    """The preprocesses' end: a gradient flowing into lse folded into Delta (dS = P * (dP - (Delta -
    dlse))), Delta stored, and with sinks (``load_lse``: lse loaded first) the sink gradient."""
    layout, bm = cfg.layout, delta.shape[0]
    for i in T.Parallel(bm):
        delta[i] -= stat_at(dLSE, layout, b, head, q_base + row0 + i)
    store_stat(Delta, layout, b, head, q_base, row0, sq, delta, bm)
    if cfg.has_sinks:
        if load_lse:
            T.copy(stat_tile(LSE, layout, b, head, q_base + row0, bm), lse)
        _sink_grad(Sinks, lse, delta, contrib, total, head, b, bx, row0, sq, dSinkAcc, dSinkPart, cfg.deterministic,
                   layout == "thd")


@T.macro
def _sink_grad(Sinks, lse, delta, contrib, total, head, b, bx, row0, sq, dSinkAcc, dSinkPart, deterministic: bool,
               packed: bool):
    """dsink[head] += -sum_rows exp(sink - lse) * Delta over this program's rows (< sq): one
    atomic, or (deterministic) the program's partial, summed on the host in a fixed order. Packed
    (thd): an idle program of the schedule (``schedule.py``: its tile starts at or past its
    sequence's end, possibly past the partials' last column) writes no partial (they start at 0)."""
    for i in T.Parallel(contrib.shape[0]):
        contrib[i] = T.if_then_else(row0 + i < sq, -T.exp2((Sinks[head] - lse[i]) * LOG2E) * delta[i], 0.0)
    T.reduce_sum(contrib, total, dim=0)
    tx = T.get_thread_binding(0)
    if tx == 0:
        if deterministic:
            if packed:
                if row0 < sq:
                    dSinkPart[b, head, bx] = total[0]
            else:
                dSinkPart[b, head, bx] = total[0]
        else:
            T.atomic_add(dSinkAcc[head], total[0])


def _build_preprocess_fast(cfg: KernelConfig, o_dtype: str, t):
    """Delta = rowsum(dO * O) - dlse from the saved output (fast mode), and the sink gradient.

    Memory-bound: one read of O and dO. O (``o_dtype``: the input dtype, fast mode) carries its
    rounding to fp16/bf16 into ``dP - Delta`` (FlashAttention's choice; the strict preprocess avoids
    it); an fp32 O (:func:`build_preprocess_o32`) does not. ``t``: its tiles.

    Outside deterministic mode it also zeroes its rows of the dQ accumulator (``dQAcc``, which the main
    backward adds into), as FlashAttention-3's preprocess does: no fill of its own per backward.
    """
    bm = t.block_m
    dim, dim_v, layout = cfg.head_dim, cfg.head_dim_v, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    s = _preprocess_shapes(cfg)
    heads, seq_q, with_dq = s.heads, s.seq_q, s.with_dq

    @T.macro
    def body(O, Q, K, V, dO, LSE, dLSE, Sinks, CuQ, CuK, window, scale, Delta, dSinkAcc, dSinkPart, dQAcc, m_tiles,
             n_seqs):
        with T.Kernel(m_tiles, heads, n_seqs, threads=t.threads) as (bx, head, b):
            o = T.alloc_fragment([bm, dim_v], o_dtype)
            do = T.alloc_fragment([bm, dim_v], dtype)
            prod = T.alloc_fragment([bm, dim_v], accum)
            lse = T.alloc_fragment([bm], accum)
            delta, contrib, total = _alloc_delta(bm)

            b, bx = locate(layout, CuQ, bx, b, bm)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            row0 = bx * bm
            if with_dq:
                clear_acc_rows(dQAcc, layout, b, head, q_base, row0, sq, bm, dim)
            T.copy(tile(O, layout, b, head, q_base + row0, bm), o)
            T.copy(tile(dO, layout, b, head, q_base + row0, bm), do)
            for i, j in T.Parallel(bm, dim_v):
                prod[i, j] = T.Cast(accum, o[i, j]) * T.Cast(accum, do[i, j])
            T.reduce_sum(prod, delta, dim=1)
            _store_delta(Delta, dLSE, LSE, Sinks, lse, delta, contrib, total, head, b, bx, q_base, row0, sq, dSinkAcc,
                         dSinkPart, cfg, True)

    return _preprocess_entry(cfg, s, "flashsink_bwd_preprocess_fast", o_dtype, body, bm)


def build_preprocess_strict(cfg: KernelConfig, t, branch: bool, lpt: bool):
    """Delta = rowsum(P * dP) (= rowsum(dO * O) exactly), and the sink gradient.

    Query-stationary like the forward: each program recomputes P and dP = dO V^T for its query tile
    (``t``: ``block_m`` rows stationary, ``block_n`` keys streaming) over the KV blocks it sees. The
    fp32 sum avoids O's rounding to fp16/bf16, which ``rowsum(dO * O)`` would carry into ``dP - Delta``
    where that difference cancels (rows with few visible keys). ``branch``: P skips the per-element
    mask on the KV tiles wholly visible to the query tile (``block_range.full_kv_blocks_for_rows``).
    ``lpt``: the causal query tiles with the most keys first, from the grid's layout (padded layouts).
    Outside deterministic mode it zeroes its rows of the dQ accumulator, as the fast one does.
    """
    if lpt and cfg.layout == "thd":
        raise ValueError(f"lpt=True needs a padded layout (bhsd or bshd); got layout={cfg.layout!r}")
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    s = _preprocess_shapes(cfg)
    heads, seq_q, seq_kv, with_dq = s.heads, s.seq_q, s.seq_kv, s.with_dq

    @T.macro
    def body(O, Q, K, V, dO, LSE, dLSE, Sinks, CuQ, CuK, window, scale, Delta, dSinkAcc, dSinkPart, dQAcc, m_tiles,
             n_seqs):
        with T.Kernel(*grid_dims(m_tiles, heads, lpt), n_seqs, threads=t.threads) as (g0, g1, b):
            bx, head = grid_coords(g0, g1, m_tiles, longest_last=True, on=lpt)
            q_s = T.alloc_shared([bm, dim], dtype)
            do_s = T.alloc_shared([bm, dim_v], dtype)
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            lse = T.alloc_fragment([bm], accum)
            p = T.alloc_fragment([bm, bn], accum)
            dp = T.alloc_fragment([bm, bn], accum)
            part = T.alloc_fragment([bm], accum)
            delta, contrib, total = _alloc_delta(bm)

            b, bx = locate(layout, CuQ, bx, b, bm)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            row0 = bx * bm
            kv_head = head // groups
            scale_log2 = scale * LOG2E
            lo, hi = kv_blocks_for_rows(row0, bm, bn, sq, sk, window, cfg.causal)
            full = None
            if branch:
                flo, fhi = full_kv_blocks_for_rows(lo, hi, row0, bm, bn, sq, sk, window, cfg.causal)
                full = (flo, fhi)  # bound once per tile, as the forward does
            if lo < hi:  # no bulk copy left in flight by a program with no keys (see fwd.py)
                T.copy(tile(Q, layout, b, head, q_base + row0, bm), q_s, prefer_instruction=prologue_load(cfg))
                T.copy(tile(dO, layout, b, head, q_base + row0, bm), do_s, prefer_instruction=prologue_load(cfg))
            if with_dq:
                clear_acc_rows(dQAcc, layout, b, head, q_base, row0, sq, bm, dim)
            T.copy(stat_tile(LSE, layout, b, head, q_base + row0, bm), lse)
            T.clear(delta)
            for kb in T.Pipelined(lo, hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s)
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s)
                probs_and_grads(q_s, do_s, k_s, v_s, lse, p, dp, row0, key0, sq, sk, window, scale_log2, cfg.causal,
                                None if full is None else in_blocks(kb, full))
                for i, j in T.Parallel(bm, bn):
                    p[i, j] *= dp[i, j]
                T.reduce_sum(p, part, dim=1)
                for i in T.Parallel(bm):
                    delta[i] += part[i]
            _store_delta(Delta, dLSE, LSE, Sinks, lse, delta, contrib, total, head, b, bx, q_base, row0, sq, dSinkAcc,
                         dSinkPart, cfg, False)

    return _preprocess_entry(cfg, s, "flashsink_bwd_preprocess", None, body, bm)


def _preprocess_shapes(cfg: KernelConfig) -> SimpleNamespace:
    """The preprocesses' dynamic sizes and their tensors' shapes (fast reads only ``o_shape``'s)."""
    layout = cfg.layout
    batch, heads, seq_q, seq_kv, rows_pad, n_part = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad, n_part")
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(layout, batch, heads, heads // cfg.groups, seq_q, seq_kv,
                                                    cfg.head_dim, cfg.head_dim_v)
    return SimpleNamespace(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, n_part=n_part, q_shape=q_shape,
                           k_shape=k_shape, v_shape=v_shape, o_shape=o_shape,
                           st_shape=stat_shape(layout, batch, heads, rows_pad), with_dq=not cfg.deterministic)


def _alloc_delta(bm: int) -> tuple:
    """``(delta, contrib, total)``: Delta's rows and :func:`_store_delta`'s scratch for the sink gradient,
    the kernel naming them by the names it unpacks them into."""
    return T.alloc_fragment([bm], "float32"), T.alloc_fragment([bm], "float32"), T.alloc_fragment([1], "float32")


def _preprocess_entry(cfg: KernelConfig, s: SimpleNamespace, name: str, o_dtype, body, bm: int):
    """The kernel ``name`` over the preprocesses' one signature: fast (``o_dtype``: O's dtype) reads O,
    strict (``o_dtype`` None) Q, K and V with the window and the scale; ``body`` takes them all (None
    where absent) and the grid of ``bm``-row query tiles."""
    layout, dtype, accum, strict = cfg.layout, cfg.dtype, "float32", o_dtype is None
    batch, heads, seq_q, st_shape, o_shape = s.batch, s.heads, s.seq_q, s.st_shape, s.o_shape
    cu, longest, n_cu = varlen_params(layout)

    @kernel(name, layout)
    def preprocess(
        O: optional(not strict, T.Tensor(o_shape, o_dtype or dtype)),  # (built either way: a dtype)
        Q: optional(strict, T.Tensor(s.q_shape, dtype)),
        K: optional(strict, T.Tensor(s.k_shape, dtype)),
        V: optional(strict, T.Tensor(s.v_shape, dtype)),
        dO: T.Tensor(o_shape, dtype),
        LSE: T.Tensor(st_shape, accum),
        dLSE: T.Tensor(st_shape, accum),
        Sinks: T.Tensor([heads], accum),
        CuQ: cu,
        CuK: cu,
        max_seqlen_q: longest,
        window: optional(strict, T.int32),
        scale: optional(strict, T.float32),
        Delta: T.Tensor(st_shape, accum),
        dSinkAcc: T.Tensor([heads], accum),
        dSinkPart: T.Tensor([batch, heads, s.n_part], accum),
        dQAcc: optional(s.with_dq, T.Tensor(st_shape + [cfg.head_dim], accum)),
    ):
        body(O, Q, K, V, dO, LSE, dLSE, Sinks, CuQ, CuK, window, scale, Delta, dSinkAcc, dSinkPart, dQAcc,
             *grid(layout, seq_q, n_cu, batch, bm))

    return preprocess


def build_bwd(cfg: KernelConfig, split: int = 1):
    """The main backward (``config.bwd_tiles``): ``bwd_ws.py``'s hand warp-specialized kernel where
    ``config.bwd_ws``, else TileLang's pipelined kernel (:func:`build_bwd_pipelined`) with the
    config's branch, swap, dQ bulk add and overlap. ``split``: see :func:`build_bwd_pipelined`."""
    t = bwd_tiles(cfg)
    if bwd_ws(cfg):
        # the ws kernel is split only where it runs head-major (config.bwd_split, bwd_head_major)
        return build_bwd_ws(cfg, t, split, bwd_dq_first(cfg), head_major=split > 1)
    return build_bwd_pipelined(cfg, t, split, bwd_branch(cfg), bwd_swap(cfg), bwd_dq_bulk(cfg), bwd_overlap(cfg))


def build_bwd_pipelined(cfg: KernelConfig, t, split: int, branch: bool, swap: bool, dq_bulk: bool, overlap: bool):
    """TileLang's main backward over tiles ``t`` (``T.Pipelined``), KV-stationary.

    ``split == 1``: a program streams every query head of its group and writes dK/dV once, in the
    input dtype. ``split > 1``: the group's query heads over that many programs per KV tile, each
    adding its share of dK/dV into fp32 accumulators (``[.., rows_pad_kv, D]``, zeroed by the host)
    that the postprocess casts. ``branch``: the per-element mask only on row blocks not wholly
    visible (``block_range.full_row_blocks_for_keys``). ``swap``: the KV tiles longest first from the
    grid's layout (KV heads along x, tiles along y; padded layouts). ``dq_bulk``: dQ tiles added by one
    bulk (TMA) reduce-add. ``overlap``: S^T and dP^T issued asynchronously back to back (Hopper wgmma).
    """
    if swap and cfg.layout == "thd":
        raise ValueError("swap=True needs a padded layout (bhsd or bshd): packed KV tiles may exceed the grid's "
                         f"y extent; got layout={cfg.layout!r}")
    per_prog = cfg.groups // split  # query heads one program streams
    dq_ann = {"use_tma": 1} if dq_bulk else None
    bm, bn = t.block_m, t.block_n  # bm query rows stream past bn resident keys
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    shapes = main_bwd_shapes(cfg, split)
    heads_kv, seq_q, seq_kv = shapes.heads_kv, shapes.seq_q, shapes.seq_kv
    dkv_dtype, with_dq = shapes.dkv_dtype, shapes.with_dq
    fast = cfg.precision == "fast"

    @T.macro
    def probs_t(pT, LSE, lse_s, head, q_base, row0, key0, sq, sk, window, scale_log2, masked: bool):
        """P^T of one tile from its logits and the rows' lse (``masked``: selected to the visible pairs)."""
        for i, j in T.Parallel(bn, bm):
            pT[i, j] = select_visible(
                T.exp2(pT[i, j] * scale_log2 - staged_stat(LSE, lse_s, layout, head, q_base + row0 + j, j) * LOG2E),
                row0 + j, key0 + i, sq, sk, window, cfg.causal, masked)

    @T.macro
    def dscores_t(pT, dpT, Delta, delta_s, head, q_base, row0, key0, sq, sk, window, scale, masked: bool):
        """dS^T of one tile from P^T, dP^T and the rows' Delta, in place of P^T."""
        for i, j in T.Parallel(bn, bm):
            pT[i, j] = select_visible(
                pT[i, j] * (dpT[i, j] - staged_stat(Delta, delta_s, layout, head, q_base + row0 + j, j)) * scale,
                row0 + j, key0 + i, sq, sk, window, cfg.causal, masked)

    @T.macro
    def body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQAcc, dK, dV, n_tiles, n_seqs):
        # not schedule.by_work's flat index arithmetic, which misleads TileLang 0.1.15's sync placement
        # here (perf-log v10): ``swap`` takes the longest-first order from the grid's own dims
        with T.Kernel(*grid_dims(n_tiles, heads_kv * split, swap), n_seqs, threads=t.threads) as (g0, g1, b):
            bx, hs = grid_coords(g0, g1, n_tiles, longest_last=False, on=swap)
            kv_head = hs // split
            head0 = kv_head * groups + (hs % split) * per_prog  # first query head of this program
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            q_s = T.alloc_shared([bm, dim], dtype)
            do_s = T.alloc_shared([bm, dim_v], dtype)
            lse_s = T.alloc_shared([bm], accum)
            delta_s = T.alloc_shared([bm], accum)
            pT = T.alloc_fragment([bn, bm], accum)  # P^T (this key tile x this query tile), then dS^T
            dpT = T.alloc_fragment([bn, bm], accum)  # dP^T
            hi = T.alloc_fragment([bn, bm], dtype)  # P^T, then dS^T, rounded (strict: the split's hi)
            dk = T.alloc_fragment([bn, dim], accum)
            dv = T.alloc_fragment([bn, dim_v], accum)
            dk_s = T.alloc_shared([bn, dim], dkv_dtype)
            dv_s = T.alloc_shared([bn, dim_v], dkv_dtype)
            lo = None if fast else T.alloc_fragment([bn, bm], dtype)  # the split's lo
            if with_dq:
                ds_hi_s = T.alloc_shared([bn, bm], dtype)
                if not fast:
                    ds_lo_s = T.alloc_shared([bn, bm], dtype)
                dq = T.alloc_fragment([bm, dim], accum)
                dq_s = T.alloc_shared([bm, dim], accum)

            if layout == "thd":  # KV tiles along the keys' cu_seqlens (padded: as launched, TIR as before)
                b, bx = locate(layout, CuK, bx, b, bn)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            key0 = bx * bn
            scale_log2 = scale * LOG2E
            lo_blk, hi_blk = row_blocks_for_keys(key0, bn, bm, sq, sk, window, cfg.causal)
            if branch:
                full_lo, full_hi = full_row_blocks_for_keys(lo_blk, hi_blk, key0, bn, bm, sq, sk, window, cfg.causal)
            n_rows = hi_blk - lo_blk
            if n_rows > 0:  # no bulk copy left in flight by a program no row sees (see fwd.py)
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s, prefer_instruction=prologue_load(cfg))
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s, prefer_instruction=prologue_load(cfg))
            T.clear(dk)
            T.clear(dv)

            # One flat loop over (query head of this program's share of the group, query tile):
            # dK/dV of this KV head accumulate across those heads without leaving the chip.
            for it in T.Pipelined(per_prog * n_rows, num_stages=t.stages):
                head = head0 + it // n_rows
                row0 = (lo_blk + it % n_rows) * bm
                T.copy(tile(Q, layout, b, head, q_base + row0, bm), q_s)
                stage_stat(LSE, layout, b, head, row0, bm, lse_s)
                if overlap:
                    # S^T and dP^T issued back to back; P is computed while dP^T runs
                    T.copy(tile(dO, layout, b, head, q_base + row0, bm), do_s)
                    T.wgmma_gemm(k_s, q_s, pT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(v_s, do_s, dpT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)
                else:
                    T.clear(pT)
                    T.gemm(k_s, q_s, pT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # the per-element mask only where this row block is not wholly visible (branch)
                branch_tile(probs_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)) if branch else None,
                            pT, LSE, lse_s, head, q_base, row0, key0, sq, sk, window, scale_log2)
                if overlap:
                    T.wait_wgmma(0)
                else:
                    T.copy(tile(dO, layout, b, head, q_base + row0, bm), do_s)
                    T.clear(dpT)
                    T.gemm(v_s, do_s, dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # dV += P^T dO (strict: as hi + lo)
                product(pT, hi, lo, do_s, dv, bn, bm, fast)
                stage_stat(Delta, layout, b, head, row0, bm, delta_s)
                # dS^T; selected, not multiplied, so a masked slot (a row of another sequence in a
                # packed batch, say) adds an exact 0 to dK and dQ
                branch_tile(dscores_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)) if branch else None,
                            pT, dpT, Delta, delta_s, head, q_base, row0, key0, sq, sk, window, scale)
                # dK += dS^T Q (strict: as hi + lo)
                product(pT, hi, lo, q_s, dk, bn, bm, fast)
                if with_dq:
                    # dQ = dS K for this tile, added into the fp32 accumulator
                    T.copy(hi, ds_hi_s)
                    T.clear(dq)
                    T.gemm(ds_hi_s, k_s, dq, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                    if not fast:
                        T.copy(lo, ds_lo_s)
                        T.gemm(ds_lo_s, k_s, dq, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(dq, dq_s)
                    T.atomic_add(acc_tile(dQAcc, layout, b, head, q_base + row0, bm), dq_s, annotations=dq_ann)

            T.copy(dk, dk_s)
            T.copy(dv, dv_s)
            if split > 1:
                # rows past the sequence hold exact zeros (their P and dS are selected to 0)
                T.atomic_add(acc_tile(dK, layout, b, kv_head, k_base + key0, bn), dk_s)
                T.atomic_add(acc_tile(dV, layout, b, kv_head, k_base + key0, bn), dv_s)
            else:
                store_rows(dK, layout, b, kv_head, k_base, key0, sk, dk_s, bn, dim)
                store_rows(dV, layout, b, kv_head, k_base, key0, sk, dv_s, bn, dim_v)

    flashsink_bwd = main_bwd_entry(cfg, shapes, body, bn)

    return flashsink_bwd


def build_bwd_split(cfg: KernelConfig):
    """The main backward with a GQA group's query heads over ``config.bwd_split(cfg)`` programs per
    KV tile (fp32 dK/dV accumulators): for problems whose KV tiles see many rows, where the unsplit
    kernel has too few programs (``dense.backward`` chooses)."""
    return build_bwd(cfg, split=bwd_split(cfg))


def build_dq(cfg: KernelConfig):
    """Deterministic dQ: each program owns a query tile and loops over its KV blocks."""
    fast = cfg.precision == "fast"
    t = dq_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    batch, heads, seq_q, seq_kv, rows_pad = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad")
    heads_kv = heads // groups
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v)
    st_shape = stat_shape(layout, batch, heads, rows_pad)

    @T.macro
    def body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQ, m_tiles, n_seqs):
        # launch order (not schedule.by_work's): that index arithmetic makes TileLang 0.1.15 put a
        # shared-memory sync in a 28-thread branch at D64 fast (compile error, 2026-12-04; see build_bwd)
        with T.Kernel(m_tiles, heads, n_seqs, threads=t.threads) as (bx, head, b):
            q_s = T.alloc_shared([bm, dim], dtype)
            do_s = T.alloc_shared([bm, dim_v], dtype)
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            lse = T.alloc_fragment([bm], accum)
            delta = T.alloc_fragment([bm], accum)
            p = T.alloc_fragment([bm, bn], accum)  # P, then dS
            dp = T.alloc_fragment([bm, bn], accum)
            ds_hi = T.alloc_fragment([bm, bn], dtype)
            ds_lo = None if fast else T.alloc_fragment([bm, bn], dtype)
            dq = T.alloc_fragment([bm, dim], accum)
            dq_s = T.alloc_shared([bm, dim], dtype)

            b, bx = locate(layout, CuQ, bx, b, bm)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            row0 = bx * bm
            kv_head = head // groups
            scale_log2 = scale * LOG2E
            lo, hi = kv_blocks_for_rows(row0, bm, bn, sq, sk, window, cfg.causal)
            if lo < hi:  # no bulk copy left in flight by a program with no keys (see fwd.py)
                T.copy(tile(Q, layout, b, head, q_base + row0, bm), q_s, prefer_instruction=prologue_load(cfg))
                T.copy(tile(dO, layout, b, head, q_base + row0, bm), do_s, prefer_instruction=prologue_load(cfg))
            T.copy(stat_tile(LSE, layout, b, head, q_base + row0, bm), lse)
            T.copy(stat_tile(Delta, layout, b, head, q_base + row0, bm), delta)
            T.clear(dq)
            for kb in T.Pipelined(lo, hi, num_stages=t.stages):
                key0 = kb * bn
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s)
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s)
                probs_and_grads(q_s, do_s, k_s, v_s, lse, p, dp, row0, key0, sq, sk, window, scale_log2, cfg.causal)
                for i, j in T.Parallel(bm, bn):
                    p[i, j] = T.if_then_else(
                        visible(row0 + i, key0 + j, sq, sk, window, cfg.causal),
                        p[i, j] * (dp[i, j] - delta[i]) * scale,
                        0.0,
                    )  # dS
                product(p, ds_hi, ds_lo, k_s, dq, bm, bn, fast)
            T.copy(dq, dq_s)
            store_rows(dQ, layout, b, head, q_base, row0, sq, dq_s, bm, dim)

    cu, longest, n_cu = varlen_params(layout)

    @kernel("flashsink_bwd_dq", layout)
    def flashsink_bwd_dq(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        dO: T.Tensor(o_shape, dtype),
        LSE: T.Tensor(st_shape, accum),
        Delta: T.Tensor(st_shape, accum),
        CuQ: cu,
        CuK: cu,
        max_seqlen_q: longest,
        window: T.int32,
        scale: T.float32,
        dQ: T.Tensor(q_shape, dtype),
    ):
        body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQ, *grid(layout, seq_q, n_cu, batch, bm))

    return flashsink_bwd_dq


def build_postprocess(cfg: KernelConfig):
    """dQ = the fp32 accumulator cast to the input dtype, in the input layout. A packed
    (``thd``) batch is one run of rows here: the accumulator rows are the token rows."""
    blk = ROW_BLOCK
    dim, dtype, accum, layout = cfg.head_dim, cfg.dtype, "float32", cfg.layout
    batch, heads, seq_q, rows_pad = T.dynamic("batch, heads, seq_q, rows_pad")
    q_shape = qkv_shapes(layout, batch, heads, heads, seq_q, seq_q, dim, dim)[0]
    acc_shape = stat_shape(layout, batch, heads, rows_pad) + [dim]
    n_seqs = row_runs(layout, batch)

    @T.prim_func
    def flashsink_bwd_postprocess(
        dQAcc: T.Tensor(acc_shape, accum),
        dQ: T.Tensor(q_shape, dtype),
    ):
        with T.Kernel(T.ceildiv(seq_q, blk), heads, n_seqs, threads=128) as (bx, head, b):
            acc = T.alloc_fragment([blk, dim], accum)
            out = T.alloc_shared([blk, dim], dtype)
            row0 = bx * blk
            T.copy(acc_tile(dQAcc, layout, b, head, row0, blk), acc)
            T.copy(acc, out)
            store_rows(dQ, layout, b, head, 0, row0, seq_q, out, blk, dim)

    return flashsink_bwd_postprocess
