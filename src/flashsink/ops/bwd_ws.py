"""The fast main backward, warp-specialized by hand for Hopper (FlashAttention-3's layout).

Same gradients, grid and arguments as ``bwd.build_bwd`` (fast precision), different schedule. With
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
barriers between the two consumers per tile (docs/perf-log.md, v6).
"""

import tilelang.language as T

from .block_range import full_row_blocks_for_keys, kv_blocks_for_rows, row_blocks_for_keys
from .config import KernelConfig
from .bwd_entry import main_bwd_entry, main_bwd_shapes
from .layout import acc_tile, prologue_load, sequence, stat_tile, store_rows, tile
from .schedule import by_work, locate
from .mask import branch_tile, in_blocks, select_visible
from .softmax import LOG2E
from .split import split as two_terms

#: registers per thread of the producer and of the consumer warpgroups (setmaxnreg), as
#: TileLang's automatic warp specialization and FlashAttention-3 choose: 24 * 128 + 240 * 256
#: fits the 64K registers of one SM
PRODUCER_REGS, CONSUMER_REGS = 24, 240
CONSUMER_THREADS = 256
#: the named barrier the consumers meet at (0 is __syncthreads; TileLang's own partial syncs use 3)
CONSUMER_BARRIER = 1
#: ``dq_cast``: the named barrier of the producer's dQ warp (its second warp, 32 threads)
DQ_BARRIER = 2


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


def build_bwd_ws(cfg: KernelConfig, t, split: int, lpt: bool = True, branch: bool = True, dq_first: bool = False,
                 skip_halves: bool = False, prefetch: str = "", dq_cast: bool = False):
    """The warp-specialized main backward for ``tiles`` ``t`` (``t.threads`` consumer threads,
    256; ``t.stages`` ring slots) and ``split`` programs per KV tile (see ``bwd.build_bwd``), issued
    longest first unless ``lpt`` is False (``schedule.by_work``). ``branch``: the per-element mask only
    on the row blocks that are not wholly visible (``block_range.full_row_blocks_for_keys``), as the
    forward's ``"branch"``; False, on every tile (tools/bwd_variants.py times both). ``dq_first``: each
    tile's dQ product issued before its dK product, and dQ handed to the producer while dK's runs
    (FlashAttention-3's order; ``config.bwd_dq_first``: head dim 64, with 128-row tiles).

    ``skip_halves`` (an option for tools/bwd_variants.py, not measured yet): a consumer skips a row
    block that its ``bn / 2`` keys cannot see (``block_range.row_blocks_for_keys`` over its half of the
    keys): no S^T, dP^T, softmax, dV or dK work, only zeros for its half of dS^T, which the shared dQ
    product reads. With 64-row blocks (D128's tiles) the first row block of a causal KV tile is
    invisible to its upper 64 keys, and under a window of 128 the last one to its lower 64: golden
    (W=128, 64x128 tiles) runs 4 row blocks per KV tile and head, of which each consumer then works
    on 3, the other having the tensor cores alone on the fourth. Off, the kernel is the one built
    without the option, TIR for TIR.

    ``prefetch`` (an option for tools/bwd_variants.py, not measured yet): ``"sdp"``, each consumer issues
    the next row block's S^T and dP^T products into a second pair of accumulators before this block's
    softmax and dS^T, so the tensor cores compute them while the consumer's elementwise work runs
    (the block's products start with S^T and dP^T ready, instead of waiting for them: ncu v11 saw the
    tensor pipe 38% busy); 64 more accumulator registers per thread (a 64x128 tile: two [128, 64]
    fp32 fragments over 256 threads). ``"s"``, the next block's S^T only (32 more registers, for
    D128's tiles where "sdp" spills): this block's dP^T is issued at its start and runs through its
    P, as without the option. The next block's slot is waited on one block earlier, so it wants 3
    ring slots. Not with ``skip_halves``.

    ``dq_cast`` (an option for tools/bwd_variants.py, not measured yet): dQ's cast fused in, no
    postprocess. The kernel takes two more arguments (``bwd_entry.main_bwd_entry``): ``dQ``, which it
    writes, and ``DqCount``, one int32 per (batch, head, row block), zeroed by the caller. The
    producer's first warp then only loads the ring; its second warp adds each dQ tile into the fp32
    accumulator as before, waits for the add to complete (one tile later: the bulk group after it may
    still run), counts it in ``DqCount`` (an acq_rel atomic) and, if it was the row block's last add
    (the count reaches the number of KV tiles that see the block, ``block_range.kv_blocks_for_rows``),
    loads the finished fp32 rows back by TMA (L2-resident: the adds just landed there) and writes dQ in
    the input dtype. The other two producer warps idle. FlashAttention-3's deterministic dQ orders its
    bulk adds through a counter the same way (complete, then a release increment). Saves the
    postprocess (golden: 48.6 us, 134 MB read and 67 MB written, v15's profile) where the casts fit in
    the producer's slack. Fast precision, padded layouts, ``split == 1``; every row block must be seen
    by some KV tile (``seq_q <= seq_kv`` when causal; ``interface._backward`` zeroes the rows that see
    no key). The library runs it where ``config.bwd_dq_cast`` says, off (``config.DQ_CAST``) until
    measured."""
    if prefetch not in ("", "s", "sdp"):
        raise ValueError(f"prefetch must be '', 's' or 'sdp', got {prefetch!r}")
    if prefetch and skip_halves:
        raise ValueError("prefetch cannot be combined with skip_halves=True")
    if dq_cast and (cfg.precision != "fast" or cfg.layout == "thd" or split != 1 or cfg.deterministic):
        raise NotImplementedError(f"dq_cast supports fast precision, padded layouts (bhsd, bshd), split=1 and "
                                  f"non-deterministic configurations; got {cfg.short()}, split={split}")
    ahead, ahead_dp = prefetch != "", prefetch == "sdp"  # (booleans: the kernel's build-time conditions)
    if not cfg.hopper or t.threads != CONSUMER_THREADS or t.stages < 1:
        raise NotImplementedError(f"the warp-specialized main backward supports Hopper (sm_90a) "
                                  f"and {CONSUMER_THREADS} consumer threads; got {cfg.short()}, {t}")
    fast = cfg.precision == "fast"
    per_prog = cfg.groups // split
    stages = t.stages
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    packed = layout == "thd"  # lse/Delta staged by plain loads (layout.py: unaligned rows)
    shapes = main_bwd_shapes(cfg, split)
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
    def dscores_t(pT, dpT, delta_r, s, row0, key0, sq, sk, window, scale, masked: bool):
        """dS^T of one tile from P^T, dP^T and the rows' Delta (ring slot ``s``), in place of P^T."""
        for i, j in T.Parallel(bn, bm):
            pT[i, j] = select_visible(
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
    def count_and_cast(dQAcc, dQ, DqCount, cast_s, cast_full, last_s, n_cast, t, pending: int, b, head0, lo_blk,
                       n_rows, sq, sk, window, tx):
        """``dq_cast``, the producer's dQ warp: tile ``t``'s add, once complete (``pending``: bulk groups
        issued after it that may still run), counted in ``DqCount``; if it was its row block's last, the
        block's fp32 rows loaded back (TMA) and written to dQ in the input dtype."""
        # the tile's coordinates once, into local variables (24 registers per producer thread: as
        # expressions TileLang would inline them, divisions included, at every use)
        head = T.alloc_var("int32")
        rb = T.alloc_var("int32")
        row0 = T.alloc_var("int32")
        head = head0 + t // n_rows
        rb = lo_blk + t % n_rows
        row0 = rb * bm
        if tx == CONSUMER_THREADS + 32:
            T.tma_store_wait(pending, read=False)
            seen_by = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            lo, hi = kv_blocks_for_rows(row0, bm, bn, sq, sk, window, cfg.causal)
            seen_by = hi - lo  # the KV tiles whose adds the block receives
            last_s[0] = T.if_then_else(
                T.atomic_add(DqCount[b, head, rb], 1, memory_order="acq_rel", return_prev=True) + 1 == seen_by, 1, 0)
        T.sync_threads(DQ_BARRIER, 32)
        if last_s[0] == 1:
            # the whole warp reaches the copy: TileLang issues it from one lane it elects with elect.sync,
            # which needs every lane of the warp (issued under ``tx == ...`` alone, the elected lane
            # waited for the other 31 at elect.sync while they waited on cast_full: the hang the H200
            # showed, docs/perf-log.md v18); the elected lane's expect_tx precedes its own arrival, and the
            # phase needs all 32 arrivals
            T.tma_copy(acc_tile(dQAcc, layout, b, head, row0, bm), cast_s, barrier=cast_full)
            T.barrier_arrive(cast_full)
            T.mbarrier_wait_parity(cast_full, n_cast[0] & 1)
            store_rows(dQ, layout, b, head, 0, row0, sq, cast_s, bm, dim)
            n_cast[0] = n_cast[0] + 1
        T.sync_threads(DQ_BARRIER, 32)  # last_s and cast_s read by the whole warp before the next tile's

    @T.macro
    def body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQAcc, dK, dV, n_tiles, n_seqs, dQ=None, DqCount=None):
        with T.Kernel(n_tiles * heads_kv * split, n_seqs, threads=CONSUMER_THREADS + 128) as (p, b):
            # the program's coordinates and row-block ranges are computed once, into local variables:
            # as expressions TileLang inlines them (divisions included) wherever they are used, and
            # lowering those took 37 s of the kernel's compile against 6 s bound (this machine's CPU)
            bx = T.alloc_var("int32")
            hs = T.alloc_var("int32")
            bx, hs = by_work(p, n_tiles, heads_kv * split, longest_last=False, lpt=lpt)
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
            if ahead:  # the next row block's S^T (and dP^T), in flight during this block's work
                pT_next = T.alloc_fragment([bn, bm], accum)
                if ahead_dp:
                    dpT_next = T.alloc_fragment([bn, bm], accum)
            p_h = T.alloc_fragment([bn, bm], dtype)  # P^T rounded: dV's A operand (registers)
            ds_h = T.alloc_fragment([bn, bm], dtype)  # dS^T rounded: dK's A operand
            # strict: the lo terms of the two-term products (split.py)
            p_l = None if fast else T.alloc_fragment([bn, bm], dtype)
            ds_l = None if fast else T.alloc_fragment([bn, bm], dtype)
            dk = T.alloc_fragment([bn, dim], accum)
            dv = T.alloc_fragment([bn, dim_v], accum)
            loaders = 32 if dq_cast else 128  # the producer threads that arrive at a slot's loads
            full = T.alloc_barrier(arrive_count=[loaders] * stages)  # slot loaded (producer + TMA bytes)
            empty = T.alloc_barrier(arrive_count=[CONSUMER_THREADS] * stages)  # slot read by both consumers
            if with_dq:
                # dS^T of two consecutive tiles: a consumer writes tile it+1's while the other may
                # still read tile it's in its dQ product
                ds_s = T.alloc_shared([2, bn, bm], dtype)
                ds_lo_s = None if fast else T.alloc_shared([2, bn, bm], dtype)
                dq = T.alloc_fragment([bm, dim], accum)
                dq_s = T.alloc_shared([bm, dim], accum)
                dq_full = T.alloc_barrier(arrive_count=CONSUMER_THREADS)  # dq_s written
                dq_empty = T.alloc_barrier(arrive_count=32 if dq_cast else 128)  # dq_s added into dQAcc
                if dq_cast:
                    cast_s = T.alloc_shared([bm, dim], accum)  # a finished row block of dQAcc, back from L2
                    cast_full = T.alloc_barrier(arrive_count=32)  # cast_s loaded (the dQ warp + TMA bytes)
                    last_s = T.alloc_shared([1], "int32")  # whether the add just counted was the block's last
                    n_cast = T.alloc_local([1], "int32")  # cast_full's phase

            if packed:  # KV tiles along the keys' cu_seqlens (padded: as launched, TIR as before)
                b, bx = locate(layout, CuK, bx, b, bn)
            q_base, sq = sequence(layout, CuQ, b, seq_q)
            k_base, sk = sequence(layout, CuK, b, seq_kv)
            key0 = bx * bn
            scale_log2 = scale * LOG2E
            lo_blk = T.alloc_var("int32")
            hi_blk = T.alloc_var("int32")
            lo_blk, hi_blk = row_blocks_for_keys(key0, bn, bm, sq, sk, window, cfg.causal)
            if branch:
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
                # dq_cast: the first producer warp loads the ring, the second writes dQ (below); without
                # it every producer thread runs this loop, which also adds dQ (a build-time True: one path)
                loads_here = tx < CONSUMER_THREADS + 32 if dq_cast else True
                adds_here = with_dq and not dq_cast
                if loads_here:
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
                        if adds_here:
                            if it > 0:  # the previous tile's dQ, while the consumers work on this one
                                prev = it - 1
                                T.mbarrier_wait_parity(dq_full, prev & 1)
                                T.atomic_add(acc_tile(dQAcc, layout, b, head0 + prev // n_rows, q_base + (lo_blk + prev % n_rows) * bm, bm),
                                             dq_s, annotations={"use_tma": 1})
                                T.barrier_arrive(dq_empty)
                    if adds_here:
                        if n_it > 0:
                            last = n_it - 1
                            T.mbarrier_wait_parity(dq_full, last & 1)
                            T.atomic_add(acc_tile(dQAcc, layout, b, head0 + last // n_rows, q_base + (lo_blk + last % n_rows) * bm, bm),
                                         dq_s, annotations={"use_tma": 1})
                if dq_cast:
                    if tx >= CONSUMER_THREADS + 32 and tx < CONSUMER_THREADS + 64:
                        # each tile's dQ added as it is handed over; the add before it counted once
                        # complete (one bulk group may still run: the one just issued), and cast
                        n_cast[0] = 0
                        for it in T.serial(n_it):
                            T.mbarrier_wait_parity(dq_full, it & 1)
                            T.atomic_add(acc_tile(dQAcc, layout, b, head0 + it // n_rows, q_base + (lo_blk + it % n_rows) * bm, bm),
                                         dq_s, annotations={"use_tma": 1})
                            T.barrier_arrive(dq_empty)
                            if it > 0:
                                count_and_cast(dQAcc, dQ, DqCount, cast_s, cast_full, last_s, n_cast, it - 1, 1, b,
                                               head0, lo_blk, n_rows, sq, sk, window, tx)
                        if n_it > 0:
                            count_and_cast(dQAcc, dQ, DqCount, cast_s, cast_full, last_s, n_cast, n_it - 1, 0, b,
                                           head0, lo_blk, n_rows, sq, sk, window, tx)
            else:
                T.set_max_nreg(CONSUMER_REGS, 1)
                T.clear(dk)
                T.clear(dv)
                if skip_halves:
                    # the row blocks this consumer's half of the keys sees (wgmma's FullRow policy
                    # gives warpgroup w rows [w * bn / 2, (w + 1) * bn / 2) of the P^T tiles)
                    own_lo = T.alloc_var("int32")
                    own_hi = T.alloc_var("int32")
                    own_lo, own_hi = row_blocks_for_keys(key0 + (tx // 128) * (bn // 2), bn // 2, bm, sq, sk, window,
                                                         cfg.causal)
                if ahead:
                    if n_it > 0:  # the first row block's S^T (and dP^T)
                        T.mbarrier_wait_parity(full[0], 0)
                        T.wgmma_gemm(k_s, q_r[0, :, :], pT_next, transpose_B=True, clear_accum=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        if ahead_dp:
                            T.wgmma_gemm(v_s, do_r[0, :, :], dpT_next, transpose_B=True, clear_accum=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                for it in T.serial(n_it):
                    s = it % stages
                    head = head0 + it // n_rows
                    row0 = (lo_blk + it % n_rows) * bm
                    if not ahead:  # (prefetch: waited on with the previous block)
                        T.mbarrier_wait_parity(full[s], (it // stages) & 1)
                    # skip_halves: whether this consumer's keys see the row block (a build-time True
                    # without the option: one path, the kernel as before)
                    live = in_blocks(lo_blk + it % n_rows, (own_lo, own_hi)) if skip_halves else True
                    if live:
                        if ahead:
                            # this block's S^T (and dP^T), issued one block ahead (the previous block's
                            # last wait already saw them through); "s": this block's dP^T now; then
                            # the next block's, running through this block's softmax, dS^T and products
                            T.wait_wgmma(0)
                            T.copy(pT_next, pT)
                            if ahead_dp:
                                T.copy(dpT_next, dpT)
                            else:
                                T.wgmma_gemm(v_s, do_r[s, :, :], dpT, transpose_B=True, clear_accum=True,
                                             policy=T.GemmWarpPolicy.FullRow)
                            if it + 1 < n_it:
                                s_next = (it + 1) % stages
                                T.mbarrier_wait_parity(full[s_next], ((it + 1) // stages) & 1)
                                T.wgmma_gemm(k_s, q_r[s_next, :, :], pT_next, transpose_B=True, clear_accum=True,
                                             policy=T.GemmWarpPolicy.FullRow)
                                if ahead_dp:
                                    T.wgmma_gemm(v_s, do_r[s_next, :, :], dpT_next, transpose_B=True, clear_accum=True,
                                                 policy=T.GemmWarpPolicy.FullRow)
                        else:
                            # S^T and dP^T back to back; P while dP^T runs
                            T.wgmma_gemm(k_s, q_r[s, :, :], pT, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                            T.wgmma_gemm(v_s, do_r[s, :, :], dpT, transpose_B=True, clear_accum=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                            T.wait_wgmma(1)
                        # the per-element mask only where this row block is not wholly visible (branch)
                        branch_tile(probs_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)) if branch else None,
                                    pT, lse_r, s, row0, key0, sq, sk, window, scale_log2)
                        # this block's dP^T ("sdp": copied in above; "s": the next S^T may still run)
                        if not ahead:
                            T.wait_wgmma(0)
                        elif not ahead_dp:
                            if it + 1 < n_it:
                                T.wait_wgmma(1)
                            else:
                                T.wait_wgmma(0)
                        # dV += P^T dO, running while dS^T is computed
                        rounded(pT, p_h, p_l)
                        product(p_h, p_l, do_r[s, :, :], dv)
                        # dS^T, selected (not multiplied): a masked slot adds an exact 0 (bwd.py)
                        branch_tile(dscores_t, in_blocks(lo_blk + it % n_rows, (full_lo, full_hi)) if branch else None,
                                    pT, dpT, delta_r, s, row0, key0, sq, sk, window, scale)
                        rounded(pT, ds_h, ds_l)
                    else:  # no key of this consumer's sees the block: its part of dS^T is 0, no dV, no dK
                        T.clear(ds_h)
                        if not fast:
                            T.clear(ds_l)
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
                    if live:
                        product(ds_h, ds_l, q_r[s, :, :], dk)
                        if early:
                            T.wait_wgmma(1 if fast else 2)  # all but dK's product(s)
                    elif early:
                        T.wait_wgmma(0)  # dQ's product is the only one
                    if early:
                        hand_dq(dq, dq_s, dq_full, dq_empty, it)
                    elif with_dq:
                        dq_product(ds_s, ds_lo_s, k_s, dq, it)
                    T.wait_wgmma(0)
                    T.barrier_arrive(empty[s])  # Q, dO, lse, Delta of this slot read
                    if with_dq and not early:
                        hand_dq(dq, dq_s, dq_full, dq_empty, it)

                if split > 1:
                    # fp32 adds straight from registers (an fp32 staging tile would not fit in
                    # shared memory); rows past the sequence hold exact zeros (P, dS selected to 0)
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

    flashsink_bwd = main_bwd_entry(cfg, shapes, body, bn, dq_cast=dq_cast)

    # Every shared-memory hand-off here is ordered by hand (mbarriers, the consumers' named
    # barrier): TileLang's automatic syncs would add three consumer meetings per tile.
    return flashsink_bwd.with_attr("tilelang_pass_configs", {"tl.disable_thread_storage_sync": True})
