"""The fast main backward, warp-specialized by hand for Hopper (FlashAttention-3's layout).

Same gradients, grid and arguments as ``bwd.build_bwd_pipelined``, a different schedule. With
``precision="strict"`` (strict's default at head dim 64, ``config.bwd_ws``; TileLang's kernel at D128,
where this one measured slower) its P and dS products are two-term, ``hi + lo`` (``split.py``): eight
wgmma per tile instead of five.
384 threads in three warpgroups:

- the **producer** (warpgroup 2, 24 registers) loads each query tile's Q, dO, lse and Delta by
  TMA into a ring of ``stages`` slots (one full/empty mbarrier pair per slot) and adds each
  finished dQ tile into the fp32 accumulator with one bulk reduce-add from shared memory, so
  the consumers never wait for that add;
- two **consumers** (warpgroups 0-1, 240 registers; each owns half of the ``bn`` resident keys)
  issue S^T and dP^T back to back, then dV, dK and dQ as asynchronous wgmma, waiting for
  a product only where its result is read; dK/dV stay in registers across the loop.

Why not TileLang's own warp specialization (``T.Pipelined``): its consumers wait for every
product (``T.gemm``) and issue the dQ reduce-add themselves, then wait for it, with four
barriers between the two consumers per tile (perf-log v6).
"""

import tilelang.language as T

from ..tir.block_range import full_row_blocks_for_keys, row_blocks_for_keys
from ...kernel_config import KernelConfig
from .bwd_entry import main_bwd_entry, main_bwd_shapes
from ..tir.layout import acc_tile, prologue_load, sequence, stat_tile, store_rows, tile
from ..tir.schedule import by_work, locate
from ..tir.mask import branch_tile, in_blocks, select_visible
from ..tir.softmax import LOG2E
from ..tir.split import split as two_terms

#: registers per thread of the producer and of the consumer warpgroups (setmaxnreg), as
#: TileLang's automatic warp specialization and FlashAttention-3 choose: 24 * 128 + 240 * 256
#: fits the 64K registers of one SM
PRODUCER_REGS, CONSUMER_REGS = 24, 240
CONSUMER_THREADS = 256
#: the named barrier the consumers meet at (0 is __syncthreads; TileLang's own partial syncs use 3)
CONSUMER_BARRIER = 1


@T.macro
def _stage_packed_stats(LSE, Delta, lse_r, delta_r, s, head, row, p, bm: int):
    """The producer's thread ``p`` (of 128) copies its share of a packed batch's lse and Delta rows
    ``row .. row + bm`` (base included) into ring slot ``s``, before the slot's arrival releases them:
    a packed row need not start 16-byte aligned, which the bulk copy requires (layout.py). Rows past the
    sequence (the next one's, or the statistics' padding) are staged too and never selected."""
    for r in T.serial(-(-2 * bm // 128)):
        i = r * 128 + p
        if i < bm:
            lse_r[s, i] = LSE[head, row + i]
        elif i < 2 * bm:
            delta_r[s, i - bm] = Delta[head, row + i - bm]


def build_bwd_ws(cfg: KernelConfig, t, split: int, dq_first: bool, ds_first: bool = False,
                 head_major: bool = False, dk_in_flight: bool = False, tma_epilogue: bool = False):
    """The warp-specialized main backward for tiles ``t`` (``t.threads`` consumer threads, 256;
    ``t.stages`` ring slots) and ``split`` programs per KV tile (``bwd.build_bwd_pipelined``), its KV
    tiles issued longest first (``schedule.by_work``), the per-element mask only on the row blocks not
    wholly visible (``block_range.full_row_blocks_for_keys``). ``dq_first``: each tile's dQ product
    issued before its dK product, dQ handed to the producer while dK's runs (FlashAttention-3's order).
    ``ds_first``: dS^T computed into dP^T's registers before P^T is rounded, dV issued once both are
    rounded (FlashAttention-3's order for D64's registers): fp32 P^T dies before dS^T's registers are
    needed, where otherwise P^T, dP^T, P^T rounded (dV's operand, in flight) and dS^T rounded are live
    at once, and ptxas serializes every wgmma (C7512 at D64's 128-row tiles, perf-log v20). The same
    products and roundings; dV no longer runs under dS^T's computation.

    ``head_major``: the programs launched head by head (every KV tile of one program's heads, longest
    first, before the next heads'), FlashAttention-4's grid: the ~132 programs running at once then
    read the Q, dO and dQ rows of a few heads, which stay in L2, instead of every head's (the
    tile-major order, where each running program is at another head and row: docs/bwd-design.md §2).
    Meant with ``split == groups`` (one program per query head; dK/dV added over the group in fp32).

    ``dk_in_flight`` (with ``dq_first``): a tile's dK product is left running into the next tile, waited for
    with that tile's S^T (FlashAttention-3's order), so the tensor cores are not idle while dQ is handed
    over and the next tile's products are issued; the ring slot it reads is released one tile later.

    ``tma_epilogue`` (with ``split > 1``): dK and dV added into their fp32 accumulators by bulk reduce-adds
    from shared memory (FlashAttention-4's epilogue), half a tile at a time through one fp32 [bn, dim / 2]
    staging tile (32 KB at D128: what shared memory has left), instead of per-thread atomics from registers
    (128 a thread, each behind its bounds tests: 3,864 -> 2,232 SASS instructions in the D128 head-major
    kernel, perf-log v36). A view over the dead K and V tiles cannot be used: TileLang gives a buffer and
    its views one layout, and the tiles' bf16 swizzle is not one the bulk add can encode as fp32."""
    if dk_in_flight and not dq_first:
        raise NotImplementedError("dk_in_flight needs dq_first (dQ's product must be waited for before dK's)")
    if tma_epilogue and (split == 1 or cfg.head_dim != cfg.head_dim_v):
        raise NotImplementedError("tma_epilogue is the split kernel's (fp32 dK/dV accumulators): split > 1 "
                                  f"and head_dim == head_dim_v only; got split {split}, {cfg.short()}")
    if not cfg.hopper or t.threads != CONSUMER_THREADS or t.stages < 1:
        raise NotImplementedError(f"the warp-specialized main backward supports Hopper (sm_90a) "
                                  f"and {CONSUMER_THREADS} consumer threads; got {cfg.short()}, {t}")
    fast = cfg.precision == "fast"
    per_prog = cfg.groups // split
    stages = t.stages
    half = cfg.head_dim // 2  # tma_epilogue's staging tile: dK/dV's columns in two halves
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    packed = layout == "thd"  # lse/Delta staged by plain loads (layout.py: unaligned rows)
    shapes = main_bwd_shapes(cfg, split)
    defer = dk_in_flight and shapes.with_dq
    heads_kv, seq_q, seq_kv, with_dq = shapes.heads_kv, shapes.seq_q, shapes.seq_kv, shapes.with_dq

    @T.macro
    def probs_t(pT, lse_r, s, row0, key0, sq, sk, window, scale_log2, masked: bool):
        """P^T of one tile from its logits and the rows' lse, staged in ring slot ``s`` (``masked``:
        selected to the visible pairs)."""
        for i, j in T.Parallel(bn, bm):
            pT[i, j] = select_visible(
                T.exp2(pT[i, j] * scale_log2 - lse_r[s, j] * LOG2E),
                row0 + j, key0 + i, sq, sk, window, cfg.causal, masked)

    @T.macro
    def dscores_t(pT, dpT, ds, delta_r, s, row0, key0, sq, sk, window, scale, masked: bool):
        """dS^T of one tile from P^T, dP^T and the rows' Delta (ring slot ``s``), into ``ds`` (P^T's
        registers or dP^T's)."""
        for i, j in T.Parallel(bn, bm):
            ds[i, j] = select_visible(
                pT[i, j] * (dpT[i, j] - delta_r[s, j]) * scale,
                row0 + j, key0 + i, sq, sk, window, cfg.causal, masked)

    @T.macro
    def dq_product(ds_s, ds_lo_s, k_s, dq, it):
        """dQ = dS K for tile ``it`` (dS^T from both consumers, in shared memory; strict: hi + lo)."""
        T.wgmma_gemm(ds_s[it % 2, :, :], k_s, dq, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        if not fast:
            T.wgmma_gemm(ds_lo_s[it % 2, :, :], k_s, dq, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def rounded(x, hi, lo):
        """``x`` as a tensor-core operand: rounded once (fast), or split into ``hi + lo`` (strict)."""
        if fast:
            T.copy(x, hi)
        else:
            two_terms(x, hi, lo, bn, bm)

    @T.macro
    def product(hi, lo, b_s, acc):
        """``acc += A @ b_s`` (asynchronous) for the rounded ``A`` of :func:`rounded`: one wgmma, or (strict)
        two, its hi and its lo term."""
        T.wgmma_gemm(hi, b_s, acc, policy=T.GemmWarpPolicy.FullRow)
        if not fast:
            T.wgmma_gemm(lo, b_s, acc, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def hand_dq(dq, dq_s, dq_full, dq_empty, it):
        """Tile ``it``'s dQ (registers) to the producer's bulk add, once tile it-1's is added."""
        T.mbarrier_wait_parity(dq_empty, (it & 1) ^ 1)
        T.copy(dq, dq_s)
        T.fence_proxy_async()
        T.barrier_arrive(dq_full)

    @T.macro
    def bulk_add(acc, stage, dst, c0: int, first: bool):
        """``dst`` (a region of an fp32 accumulator, [bn, half]) += ``acc``'s columns ``c0 .. c0 + half``
        by a bulk reduce-add through ``stage`` (shared memory); past the ``first``, the consumers meet before
        they write it, so the previous add has read it (its one issuing thread waits for that)."""
        if not first:
            T.sync_threads(CONSUMER_BARRIER, CONSUMER_THREADS)
        T.copy(acc[:, c0 : c0 + half], stage)
        T.fence_proxy_async()
        T.sync_threads(CONSUMER_BARRIER, CONSUMER_THREADS)
        T.atomic_add(dst, stage, annotations={"use_tma": 1})

    @T.macro
    def body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQAcc, dK, dV, n_tiles, n_seqs):
        with T.Kernel(n_tiles * heads_kv * split, n_seqs, threads=CONSUMER_THREADS + 128) as (p, b):
            # the program's coordinates and row-block ranges are computed once, into local variables:
            # as expressions TileLang inlines them (divisions included) wherever they are used, and
            # lowering those took 37 s of the kernel's compile against 6 s bound (this machine's CPU)
            bx = T.alloc_var("int32")
            hs = T.alloc_var("int32")
            bx, hs = by_work(p, n_tiles, heads_kv * split, longest_last=False, lpt=not head_major)
            kv_head = hs // split
            head0 = kv_head * groups + (hs % split) * per_prog
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            q_r = T.alloc_shared([stages, bm, dim], dtype)  # the ring the producer fills
            do_r = T.alloc_shared([stages, bm, dim_v], dtype)
            lse_r = T.alloc_shared([stages, bm], accum)
            delta_r = T.alloc_shared([stages, bm], accum)
            pT = T.alloc_fragment([bn, bm], accum)  # P^T, then dS^T
            dpT = T.alloc_fragment([bn, bm], accum)
            p_h = T.alloc_fragment([bn, bm], dtype)  # P^T rounded: dV's A operand (registers)
            ds_h = T.alloc_fragment([bn, bm], dtype)  # dS^T rounded: dK's A operand
            # strict: the lo terms of the two-term products (split.py)
            p_l = None if fast else T.alloc_fragment([bn, bm], dtype)
            ds_l = None if fast else T.alloc_fragment([bn, bm], dtype)
            dk = T.alloc_fragment([bn, dim], accum)
            dv = T.alloc_fragment([bn, dim_v], accum)
            full = T.alloc_barrier(arrive_count=[128] * stages)  # slot loaded (producer + TMA bytes)
            empty = T.alloc_barrier(arrive_count=[CONSUMER_THREADS] * stages)  # slot read by both consumers
            if tma_epilogue:  # fp32 dK/dV staged for their bulk adds, half a tile at a time (32 KB at D128)
                kv_stage = T.alloc_shared([bn, half], accum)
            if with_dq:
                # dS^T of two consecutive tiles: a consumer writes tile it+1's while the other may
                # still read tile it's in its dQ product
                ds_s = T.alloc_shared([2, bn, bm], dtype)
                ds_lo_s = None if fast else T.alloc_shared([2, bn, bm], dtype)
                dq = T.alloc_fragment([bm, dim], accum)
                dq_s = T.alloc_shared([bm, dim], accum)
                dq_full = T.alloc_barrier(arrive_count=CONSUMER_THREADS)  # dq_s written
                dq_empty = T.alloc_barrier(arrive_count=128)  # dq_s added into dQAcc

            if packed:  # KV tiles along the keys' cu_seqlens (padded: as launched, TIR as before)
                b, bx = locate(layout, CuK, bx, b, bn)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            key0 = bx * bn
            scale_log2 = scale * LOG2E
            lo_blk = T.alloc_var("int32")
            hi_blk = T.alloc_var("int32")
            lo_blk, hi_blk = row_blocks_for_keys(key0, bn, bm, sq, sk, window, cfg.causal)
            full_lo = T.alloc_var("int32")
            full_hi = T.alloc_var("int32")
            full_lo, full_hi = full_row_blocks_for_keys(lo_blk, hi_blk, key0, bn, bm, sq, sk, window, cfg.causal)
            n_rows = hi_blk - lo_blk
            n_it = per_prog * n_rows
            if n_rows > 0:  # no bulk copy left in flight by a program no row sees (see fwd.py)
                T.copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_s, prefer_instruction=prologue_load(cfg))
                T.copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_s, prefer_instruction=prologue_load(cfg))
            tx = T.get_thread_binding()

            if tx >= CONSUMER_THREADS:
                T.set_max_nreg(PRODUCER_REGS, 0)
                # the ring's loads, and each tile's dQ added while the consumers work on the next one
                for it in T.serial(n_it):
                    s = it % stages
                    head = head0 + it // n_rows
                    row0 = (lo_blk + it % n_rows) * bm
                    T.mbarrier_wait_parity(empty[s], ((it // stages) & 1) ^ 1)
                    T.tma_copy(tile(Q, layout, b, head, q_base + row0, bm), q_r[s, :, :], barrier=full[s])
                    T.tma_copy(tile(dO, layout, b, head, q_base + row0, bm), do_r[s, :, :], barrier=full[s])
                    if not packed:
                        T.tma_copy(stat_tile(LSE, layout, b, head, row0, bm), lse_r[s, :], barrier=full[s])
                        T.tma_copy(stat_tile(Delta, layout, b, head, row0, bm), delta_r[s, :], barrier=full[s])
                    else:
                        _stage_packed_stats(LSE, Delta, lse_r, delta_r, s, head, q_base + row0, tx - CONSUMER_THREADS, bm)
                    T.barrier_arrive(full[s])
                    if with_dq:
                        if it > 0:  # the previous tile's dQ, while the consumers work on this one
                            prev = it - 1
                            T.mbarrier_wait_parity(dq_full, prev & 1)
                            T.atomic_add(acc_tile(dQAcc, layout, b, head0 + prev // n_rows, q_base + (lo_blk + prev % n_rows) * bm, bm),
                                         dq_s, annotations={"use_tma": 1})
                            T.barrier_arrive(dq_empty)
                if with_dq:
                    if n_it > 0:
                        last = n_it - 1
                        T.mbarrier_wait_parity(dq_full, last & 1)
                        T.atomic_add(acc_tile(dQAcc, layout, b, head0 + last // n_rows, q_base + (lo_blk + last % n_rows) * bm, bm),
                                     dq_s, annotations={"use_tma": 1})
            else:
                T.set_max_nreg(CONSUMER_REGS, 1)
                T.clear(dk)
                T.clear(dv)
                for it in T.serial(n_it):
                    s = it % stages
                    head = head0 + it // n_rows
                    row0 = (lo_blk + it % n_rows) * bm
                    T.mbarrier_wait_parity(full[s], (it // stages) & 1)
                    # S^T and dP^T back to back; P while dP^T runs
                    T.wgmma_gemm(k_s, q_r[s, :, :], pT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(v_s, do_r[s, :, :], dpT, transpose_B=True, clear_accum=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)  # S^T (and the previous tile's dK, when in flight)
                    if defer and it > 0:
                        T.barrier_arrive(empty[(it - 1) % stages])  # its last reader, dK, is done
                    # the per-element mask only where this row block is not wholly visible
                    branch_tile(probs_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)),
                                pT, lse_r, s, row0, key0, sq, sk, window, scale_log2)
                    T.wait_wgmma(0)
                    # dS^T, selected (not multiplied): a masked slot adds an exact 0 (bwd.py)
                    if ds_first:  # into dP^T, so P^T's fp32 registers die at its rounding; then dV
                        branch_tile(dscores_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)),
                                    pT, dpT, dpT, delta_r, s, row0, key0, sq, sk, window, scale)
                        rounded(pT, p_h, p_l)
                        rounded(dpT, ds_h, ds_l)
                        product(p_h, p_l, do_r[s, :, :], dv)
                    else:  # dV += P^T dO, running while dS^T is computed into P^T
                        rounded(pT, p_h, p_l)
                        product(p_h, p_l, do_r[s, :, :], dv)
                        branch_tile(dscores_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)),
                                    pT, dpT, pT, delta_r, s, row0, key0, sq, sk, window, scale)
                        rounded(pT, ds_h, ds_l)
                    if with_dq:
                        # dS^T to shared memory for dQ = dS K, which needs both consumers' keys
                        T.copy(ds_h, ds_s[it % 2, :, :])
                        if not fast:
                            T.copy(ds_l, ds_lo_s[it % 2, :, :])
                        T.fence_proxy_async()
                        # the one meeting of the consumers per tile; it also orders this tile's
                        # write of ds_s[it % 2] after the other's read of it two tiles ago
                        T.sync_threads(CONSUMER_BARRIER, CONSUMER_THREADS)
                    # dK += dS^T Q and dQ = dS K; dq_first: dQ's product first, handed off while dK's runs
                    early = dq_first and with_dq
                    if early:
                        dq_product(ds_s, ds_lo_s, k_s, dq, it)
                    product(ds_h, ds_l, q_r[s, :, :], dk)
                    if early:
                        T.wait_wgmma(1 if fast else 2)  # all but dK's product(s)
                        hand_dq(dq, dq_s, dq_full, dq_empty, it)
                    elif with_dq:
                        dq_product(ds_s, ds_lo_s, k_s, dq, it)
                    if not defer:
                        T.wait_wgmma(0)
                        T.barrier_arrive(empty[s])  # Q, dO, lse, Delta of this slot read
                    if with_dq and not early:
                        hand_dq(dq, dq_s, dq_full, dq_empty, it)
                if defer:
                    T.wait_wgmma(0)  # the last tile's dK

                if tma_epilogue:
                    # (a program no row sees adds nothing; ptxas serializes every wgmma if dk and dv are read
                    # on that path too, C7515, the zeros it puts there counted as defining accumulators)
                    # (buffers are named in the loops, not bound to loop variables: a bound buffer takes its name)
                    if n_it > 0:
                        for c0 in (0, half):
                            bulk_add(dk, kv_stage, acc_tile(dK, layout, b, kv_head, k_base + key0, bn, c0, c0 + half),
                                     c0, c0 == 0)
                        for c0 in (0, half):
                            bulk_add(dv, kv_stage, acc_tile(dV, layout, b, kv_head, k_base + key0, bn, c0, c0 + half),
                                     c0, False)
                elif split > 1:
                    # fp32 adds straight from registers (a whole fp32 staging tile does not fit in shared
                    # memory; tma_epilogue stages halves); rows past the sequence hold exact zeros (P, dS selected to 0)
                    T.atomic_add(acc_tile(dK, layout, b, kv_head, k_base + key0, bn), dk)
                    T.atomic_add(acc_tile(dV, layout, b, kv_head, k_base + key0, bn), dv)
                else:
                    # staged through the K and V tiles, once both consumers are done with them
                    T.sync_threads(CONSUMER_BARRIER, CONSUMER_THREADS)
                    T.copy(dk, k_s)
                    T.copy(dv, v_s)
                    T.sync_threads(CONSUMER_BARRIER, CONSUMER_THREADS)
                    store_rows(dK, layout, b, kv_head, k_base, key0, sk, k_s, bn, dim)
                    store_rows(dV, layout, b, kv_head, k_base, key0, sk, v_s, bn, dim_v)

    flashsink_bwd = main_bwd_entry(cfg, shapes, body, bn)

    # Every shared-memory hand-off here is ordered by hand (mbarriers, the consumers' named
    # barrier): TileLang's automatic syncs would add three consumer meetings per tile.
    return flashsink_bwd.with_attr("tilelang_pass_configs", {"tl.disable_thread_storage_sync": True})
