"""The forward, warp-specialized by hand for Hopper (FlashAttention-3's schedule).

Same outputs and arguments as ``fwd.build_fwd_pipelined`` (o and lse bitwise equal), a different
schedule: a persistent grid of programs looping over the (row tile, head, sequence) tiles, each with
``block_m / 64`` consumer warpgroups (each owns 64 query rows of the tile) and one producer warpgroup:

- the **producer** (24 registers) loads the tile's Q and each K and V tile by TMA into a ring of
  ``stages`` slots, K and V with barriers of their own, so a consumer starts QK^T as soon as K lands;
- each **consumer** issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back as asynchronous wgmma,
  waits for S_j only, computes its softmax while P_{j-1} V_{j-1} runs, then rescales O and keeps P_j
  in registers (the next PV product's A operand); the consumers take turns to issue (ping-pong).

Masking as ``fwd.py``'s ``"branch"``: only the KV tiles that are not wholly visible evaluate the mask,
through each row's key limits (``mask.limit_logits``).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ..tir import softmax
from ..tir.block_range import full_kv_blocks_for_rows, kv_blocks_for_rows
from ...kernel_config import KernelConfig, Tiles, pack_gqa_fits
from .fwd_entry import fwd_entry, fwd_shapes
from ..tir.layout import sequence, store_rows, store_rows_vec, store_stat, tile, tile_head, tile_row
from ..tir.mask import branch_logits
from ..tir.schedule import locate, persistent_steps, persistent_tile
from ..tir.split import split as two_terms

#: registers per thread of the producer warpgroup (setmaxnreg); the consumers share the rest of
#: the SM's 64K (240 each for two consumer warpgroups, as FlashAttention-3 and TileLang choose)
PRODUCER_REGS = 24
#: rows of the query tile per consumer warpgroup (one wgmma's M)
ROWS_PER_CONSUMER = 64
#: the named barrier the consumers meet at around the epilogue (0 is __syncthreads)
CONSUMER_BARRIER = 1
#: programs of the persistent grid: one per SM of an H100/H200 SXM (132 SMs; each program needs
#: most of an SM's shared memory and registers). A Hopper part with fewer SMs (the H100 PCIe's 114)
#: runs the rest in a second round; more SMs stay idle.
PERSISTENT_CTAS = 132
#: the first of the consumers' scheduler barriers (one per consumer warpgroup; ids up to 15)
PINGPONG_BARRIER = 4
#: the first of the barriers each consumer warpgroup meets alone around its rows of the staged output
#: (``epilogue="wg"`` and ``"tma"``; one per consumer warpgroup, after the scheduler barriers)
STORE_BARRIER = 8
#: ``epilogue=`` values of :func:`build_fwd_ws`
EPILOGUES = ("smem", "regs", "wg", "tma")


def consumer_regs(n_consumers: int) -> int:
    """setmaxnreg of each consumer warpgroup: what the producer leaves of the SM's 64K registers,
    rounded down to a multiple of 8 and at most 240."""
    launch = 65536 // (128 * (n_consumers + 1)) // 8 * 8
    left = (launch * 128 * (n_consumers + 1) - 128 * PRODUCER_REGS) // (128 * n_consumers)
    return min(240, left // 8 * 8)


def _check(cfg: KernelConfig, t: Tiles, o32: bool, epilogue: str, q_slots: int):
    """The options :func:`build_fwd_ws` refuses (ValueError for a bad value, NotImplementedError for a
    configuration the kernel does not cover)."""
    if q_slots not in (1, 2):
        raise ValueError(f"q_slots must be 1 or 2, got {q_slots!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if epilogue == "tma" and (cfg.layout == "thd" or o32 or cfg.head_dim_v % 64):
        raise NotImplementedError(f"epilogue='tma' stores o by TMA in padded layouts (bshd, bhsd: a box clips at the "
                                  f"sequence's end, a packed batch's next sequence would not be), value head dims "
                                  f"of multiples of 64, without o32; got {cfg.short()}, o32={o32}")
    if epilogue == "wg" and cfg.head_dim_v % 16:
        raise NotImplementedError(f"epilogue='wg' stores a warpgroup's 64 rows 16 bytes a thread, 128 threads at a time: "
                                  f"value head dims that are multiples of 16; got {cfg.head_dim_v}")
    if o32 and cfg.precision != "strict":
        raise ValueError(f"o32=True is strict's forward (two-term P @ V, fp32 O for the backward); got {cfg.short()}")
    if not cfg.hopper or t.block_m % ROWS_PER_CONSUMER or t.stages < 1:
        raise NotImplementedError(f"the warp-specialized forward supports Hopper (sm_90a) and query tiles of a "
                                  f"multiple of {ROWS_PER_CONSUMER} rows; got {cfg.short()}, {t}")


def build_fwd_ws(cfg: KernelConfig, t: Tiles, fold: bool = False, o32: bool = False, epilogue: str = "smem",
                 q_slots: int = 1, pack_gqa: bool = False):
    """The warp-specialized forward for tiles ``t``: ``t.block_m`` a multiple of 64 (one consumer
    warpgroup per 64 rows, ``t.threads`` their threads; the kernel runs 128 more, the producer's),
    ``t.stages`` ring slots for K and V. The library's options are ``config.fwd_ws_options``'s.

    - ``fold``: the scale folded into the exponent's FMA (``softmax.new_max``'s ``scale_log2``; needs a
      positive scale: ``config.fwd_fold``, the kind ``fwd_unfolded`` for the others).
    - ``o32`` (the kind ``fwd_o32``): P @ V as two-term products (``split.py``) and the normalized output
      also written in fp32 to one more output, ``O32``, for strict's backward's Delta.
    - ``epilogue``: "smem" stages o in shared memory between two barriers of every consumer thread and
      stores it row by row; "regs" stores o from each thread's registers; "wg" stages each consumer
      warpgroup's 64 rows between barriers of its own and stores them 16 bytes a thread
      (``layout.store_rows_vec``); "tma" stages as "wg" and stores by TMA from one thread
      (:func:`_store_o_tma`; padded layouts only).
    - ``q_slots`` (1 or 2): with 2 the producer loads the next tile's Q while the consumers compute on
      this one's.
    - ``pack_gqa``: a tile holds the ``groups`` query heads of one KV head, ``block_m / groups``
      positions of each, head after head (``layout.tile_head``, ``tile_row``), so one K/V tile serves
      the group (``config.pack_gqa_fits``; :func:`_pack_rows`).
    """
    _check(cfg, t, o32, epilogue, q_slots)
    bm, bn, stages = t.block_m, t.block_n, t.stages
    pack = _pack_rows(cfg, bm) if pack_gqa else None
    rows = bm if pack is None else pack  # query positions per tile
    n_consumers = bm // ROWS_PER_CONSUMER
    consumers = 128 * n_consumers
    regs = consumer_regs(n_consumers)
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    shapes = fwd_shapes(cfg)
    heads, seq_q, seq_kv = shapes.heads, shapes.seq_q, shapes.seq_kv

    @T.macro
    def body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, m_tiles, n_seqs, O32=None):
        total = _row_tiles(m_tiles, LSE, layout, pack) * _units(heads, groups, pack) * n_seqs
        n_ctas = T.min(total, PERSISTENT_CTAS)
        with T.Kernel(n_ctas, threads=consumers + 128) as cta:
            q_s = T.alloc_shared([bm, dim] if q_slots == 1 else [q_slots, bm, dim], dtype)
            k_r = T.alloc_shared([stages, bn, dim], dtype)  # the rings the producer fills
            v_r = T.alloc_shared([stages, bn, dim_v], dtype)
            if epilogue in ("smem", "wg", "tma"):
                o_s = T.alloc_shared([bm, dim_v], dtype)
                if epilogue in ("wg", "tma"):  # swizzled: the accumulator's rows, 128 bytes apart, land in different banks
                    T.annotate_layout({o_s: make_swizzled_layout(o_s)})
            else:
                o_r = T.alloc_fragment([bm, dim_v], dtype)  # o in the input dtype, stored from registers
            acc_s = T.alloc_fragment([bm, bn], accum)  # logits, then probabilities
            p = T.alloc_fragment([bm, bn], dtype)  # the previous tile's probabilities: PV's A operand
            if o32:
                p_lo = T.alloc_fragment([bm, bn], dtype)  # their second term
            else:
                p_lo = None
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            m, m_prev, alpha, row_sum, l, lse = softmax.alloc_state(bm)
            # each row's last visible and last hidden key, relative to the tile's first (mask.limit_logits)
            key_hi = T.alloc_fragment([bm], "int32")
            key_lo = T.alloc_fragment([bm], "int32")
            limits = (key_hi, key_lo)
            q_full = T.alloc_barrier(arrive_count=128 if q_slots == 1 else [128] * q_slots)  # Q landed
            q_empty = T.alloc_barrier(arrive_count=consumers if q_slots == 1 else [consumers] * q_slots)  # Q read
            k_full = T.alloc_barrier(arrive_count=[128] * stages)
            v_full = T.alloc_barrier(arrive_count=[128] * stages)
            k_empty = T.alloc_barrier(arrive_count=[consumers] * stages)  # slot read by every consumer
            v_empty = T.alloc_barrier(arrive_count=[consumers] * stages)
            # the K/V tiles and the Q tiles this program has gone through: ring slots and barrier
            # phases continue from one row tile to the next
            kv_done = T.alloc_var("int32", init=0)
            q_done = T.alloc_var("int32", init=0)
            # the current tile's coordinates and key-block range, computed once per tile (as
            # expressions they would be re-derived, divisions included, wherever they are used)
            bx = T.alloc_var("int32")
            head = T.alloc_var("int32")
            b = T.alloc_var("int32")
            q_base = T.alloc_var("int32")
            sq = T.alloc_var("int32")
            k_base = T.alloc_var("int32")
            sk = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            tx = T.get_thread_binding()
            wg = tx // 128  # the consumer warpgroup


            if tx >= consumers:
                T.set_max_nreg(PRODUCER_REGS, 0)
                steps = persistent_steps(cta, total, n_ctas)
                for step in T.serial(steps):
                    bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                        persistent_tile(cta, step, n_ctas), _row_tiles(m_tiles, LSE, layout, pack),
                        _units(heads, groups, pack),
                        n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                    kv_head = head // groups if pack is None else head
                    # a tile that visits no keys loads nothing (its consumers wait for nothing)
                    if hi > lo:
                        _load_q(Q, layout, b, head, q_base, bx, q_s, q_full, q_empty, q_done, q_slots, bm, pack,
                                groups, dim)
                        q_done = q_done + 1
                    for it in T.serial(hi - lo):
                        c = kv_done + it
                        s = c % stages
                        phase = ((c // stages) & 1) ^ 1
                        key0 = (lo + it) * bn
                        T.mbarrier_wait_parity(k_empty[s], phase)
                        T.tma_copy(tile(K, layout, b, kv_head, k_base + key0, bn), k_r[s, :, :], barrier=k_full[s])
                        T.barrier_arrive(k_full[s])
                        T.mbarrier_wait_parity(v_empty[s], phase)
                        T.tma_copy(tile(V, layout, b, kv_head, k_base + key0, bn), v_r[s, :, :], barrier=v_full[s])
                        T.barrier_arrive(v_full[s])
                    kv_done = kv_done + (hi - lo)
            else:
                T.set_max_nreg(regs, 1)
                _pingpong_start(wg)
                for step in T.serial(persistent_steps(cta, total, n_ctas)):
                    bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                        persistent_tile(cta, step, n_ctas), _row_tiles(m_tiles, LSE, layout, pack),
                        _units(heads, groups, pack),
                        n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                    row0 = bx * rows  # the tile's first query position
                    flo, fhi = full_kv_blocks_for_rows(lo, hi, row0, rows, bn, sq, sk, window, cfg.causal)
                    n = hi - lo
                    T.fill(acc_o, 0)
                    softmax.init_state(m, l, Sinks, _first_head(head, groups, pack), bm, cfg.has_sinks, pack)
                    if n > 0:
                        T.mbarrier_wait_parity(_q_slot(q_full, q_done, q_slots), _q_phase(q_done, q_slots))
                        # the first KV tile: S_0, its softmax, P_0 kept for the next step's PV product
                        s0 = kv_done % stages
                        T.mbarrier_wait_parity(k_full[s0], (kv_done // stages) & 1)
                        T.sync_threads(PINGPONG_BARRIER + wg, 256)  # this warpgroup's turn
                        T.wgmma_gemm(_q_slot(q_s, q_done, q_slots), k_r[s0, :, :], acc_s, transpose_B=True,
                                     clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.named_barrier_arrive(PINGPONG_BARRIER + (wg + 1) % n_consumers, 256)  # the next's
                        T.wait_wgmma(0)
                        T.barrier_arrive(k_empty[s0])
                        branch_logits(acc_s, row0, lo * bn, sq, sk, window, scale_log2, fold, (flo, fhi), lo,
                                      cfg.causal, pack, limits)
                        softmax.new_max(acc_s, m, m_prev, alpha, row_sum, bm, scale_log2 if fold else None)
                        softmax.exp_sum(acc_s, m, alpha, row_sum, l, bm, bn, scale_log2 if fold else None)
                        _keep_p(acc_s, p, p_lo, bm, bn, o32)
                    for it in T.serial(1, T.max(n, 1)):
                        c = kv_done + it
                        s = c % stages
                        sp = (c - 1) % stages
                        T.mbarrier_wait_parity(k_full[s], (c // stages) & 1)
                        T.mbarrier_wait_parity(v_full[sp], ((c - 1) // stages) & 1)
                        T.sync_threads(PINGPONG_BARRIER + wg, 256)
                        T.wgmma_gemm(_q_slot(q_s, q_done, q_slots), k_r[s, :, :], acc_s, transpose_B=True,
                                     clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.wgmma_gemm(p, v_r[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        if o32:
                            T.wgmma_gemm(p_lo, v_r[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.named_barrier_arrive(PINGPONG_BARRIER + (wg + 1) % n_consumers, 256)
                        T.wait_wgmma(2 if o32 else 1)  # S_it; P_{it-1} V_{it-1} still runs
                        T.barrier_arrive(k_empty[s])
                        kb = lo + it
                        branch_logits(acc_s, row0, kb * bn, sq, sk, window, scale_log2, fold, (flo, fhi), kb,
                                      cfg.causal, pack, limits)
                        softmax.new_max(acc_s, m, m_prev, alpha, row_sum, bm, scale_log2 if fold else None)
                        softmax.exp_sum(acc_s, m, alpha, row_sum, l, bm, bn, scale_log2 if fold else None)
                        T.wait_wgmma(0)
                        T.barrier_arrive(v_empty[sp])
                        softmax.rescale(acc_o, alpha, bm, dim_v)
                        _keep_p(acc_s, p, p_lo, bm, bn, o32)
                    if n > 0:
                        # every S product read Q: the next tile's may land
                        T.barrier_arrive(_q_slot(q_empty, q_done, q_slots))
                        q_done = q_done + 1
                        last = (kv_done + n - 1) % stages
                        T.mbarrier_wait_parity(v_full[last], ((kv_done + n - 1) // stages) & 1)
                        T.wgmma_gemm(p, v_r[last, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        if o32:
                            T.wgmma_gemm(p_lo, v_r[last, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.barrier_arrive(v_empty[last])
                    kv_done = kv_done + n
                    softmax.finalize(acc_o, m, l, lse, bm, dim_v)
                    if epilogue == "smem":
                        T.copy(acc_o, o_s)
                        T.sync_threads(CONSUMER_BARRIER, consumers)  # o_s whole before the rows are stored
                        store_rows(O, layout, b, _first_head(head, groups, pack), q_base, row0, sq, o_s, bm, dim_v,
                                   pack)
                    elif epilogue in ("wg", "tma"):  # this warpgroup's rows, by its own threads (tma: one)
                        if epilogue == "tma":
                            T.tma_store_wait(0)  # (the issuing thread) the last tile's stores have read o_s
                        T.sync_threads(STORE_BARRIER + wg, 128)  # its rows of o_s read by the last tile's stores
                        T.copy(acc_o, o_s)
                        if epilogue == "tma":
                            T.fence_proxy_async()  # the rows written here visible to the bulk copy
                        T.sync_threads(STORE_BARRIER + wg, 128)  # ... and whole before they are stored
                        if epilogue == "wg":
                            store_rows_vec(O, layout, b, _first_head(head, groups, pack), q_base, row0, sq, o_s,
                                           wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER, dim_v, tx % 128, 128, pack)
                        else:
                            _store_o_tma(O, layout, b, _first_head(head, groups, pack), q_base, row0, o_s, wg,
                                         pack, dim_v)
                    else:  # (the buffer's name is part of the kernel's text: the default keeps "o_s")
                        T.copy(acc_o, o_r)
                        store_rows(O, layout, b, _first_head(head, groups, pack), q_base, row0, sq, o_r, bm, dim_v,
                                   pack)
                    store_stat(LSE, layout, b, _first_head(head, groups, pack), q_base, row0, sq, lse, bm, pack)
                    if o32:
                        store_rows(O32, layout, b, _first_head(head, groups, pack), q_base, row0, sq, acc_o, bm,
                                   dim_v, pack)
                    if epilogue == "smem":
                        T.sync_threads(CONSUMER_BARRIER, consumers)  # o_s read before the next tile writes it
                if epilogue == "tma":
                    T.tma_store_wait(0)  # the program's last stores have read o_s before it exits

    # the grid's row tiles are tiles of `rows` positions (packed: fewer positions than the tile's rows)
    flashsink_fwd = fwd_entry(cfg, shapes, body, rows, o32)
    # Every shared-memory hand-off is ordered by hand (mbarriers, the consumers' named barrier).
    return flashsink_fwd.with_attr("tilelang_pass_configs", {"tl.disable_thread_storage_sync": True})


def _pack_rows(cfg: KernelConfig, bm: int) -> int:
    """Positions per packed tile (``pack_gqa``): ``bm / groups``, a whole number of 8-row swizzle atoms."""
    # head dim 64: a Q row is one 128-byte swizzle row, so one head's rows are one box; at 128 each
    # head's rows are two boxes, one per 64-column half of the buffer (the library packs at 128 under a
    # window only, the kind fwd_window: config.fwd_ws_options)
    if not pack_gqa_fits(cfg, bm):
        raise NotImplementedError(
            f"pack_gqa packs a GQA group's heads into {bm}-row tiles at head dims 64 and 128 where groups "
            f"divides {bm} into whole groups of 8 rows; got head dim {cfg.head_dim}, groups {cfg.groups}")
    return bm // cfg.groups


def _row_tiles(m_tiles, lse, layout: str, pack):
    """Row tiles per sequence: the grid's ``m_tiles``, or (packed, padded layouts) tiles of ``pack``
    positions over the statistics' padded rows. A packed batch (thd) keeps the grid's program slots:
    ``fwd_entry`` counts them for tiles of ``pack`` positions (``schedule.grid``), and its rows past a
    sequence belong to the next one, so nothing pads them."""
    return m_tiles if pack is None or layout == "thd" else T.ceildiv(lse.shape[2], pack)


def _units(heads, groups: int, pack):
    """What a row tile is repeated over: the query heads, or (packed) the KV heads."""
    return heads if pack is None else heads // groups


@T.macro
def _store_o_tma(O, layout: str, b, h0, q_base, row0, o_s, wg, pack, dim_v: int):
    """``epilogue="tma"``: warpgroup ``wg``'s 64 rows of the staged o (swizzled) stored by TMA, one box of 8 rows
    (a packed tile's heads change every ``pack`` rows, a multiple of 8) and 64 columns at a time, issued by one
    thread of the warpgroup; rows past the sequence's end fall outside the tensor and are not written."""
    for k in T.unroll(ROWS_PER_CONSUMER // 8):
        for hc in T.unroll(dim_v // 64):
            r = wg * ROWS_PER_CONSUMER + k * 8
            T.tma_copy(o_s[r : r + 8, hc * 64 : hc * 64 + 64],
                       tile(O, layout, b, tile_head(h0, r, pack), q_base + tile_row(row0, r, pack), 8, hc * 64, 64),
                       leader_scope_threads=128)


def _first_head(head, groups: int, pack):
    """The first query head of a tile of unit ``head`` (a query head, or a packed tile's KV head)."""
    return head if pack is None else head * groups


def _q_rows(q_s, q_done, q_slots: int, r0: int, n: int, c0=None, nc=None):
    """Rows ``r0 .. r0+n`` of the Q buffer's slot for the ``q_done``-th tile (a packed tile's head);
    columns ``c0 .. c0+nc`` of them if given."""
    cols = slice(None) if c0 is None else slice(c0, c0 + nc)
    if q_slots == 1:
        return q_s[r0 : r0 + n, cols]
    return q_s[q_done % q_slots, r0 : r0 + n, cols]


def _q_slot(x, q_done, q_slots: int):
    """Of the Q buffer ``q_s`` or its barriers ``q_full`` / ``q_empty`` (``x``), the slot of the query tile
    after the ``q_done`` this program has gone through (one slot: ``x`` itself). Expressions at each use,
    not names: a name would be a Let of its own in the kernel (the one-slot kernel stays the library's)."""
    if q_slots == 1:
        return x
    return x[q_done % q_slots, :, :] if len(x.shape) == 3 else x[q_done % q_slots]


def _q_phase(q_done, q_slots: int):
    """The phase of that slot's barriers."""
    return q_done & 1 if q_slots == 1 else (q_done // q_slots) & 1


def _locate(i, m_tiles, heads, n_seqs, CuQ, CuK, seq_q, seq_kv, window, bm: int, bn: int, layout: str, causal: bool):
    """Tile ``i`` of the ``m_tiles x heads x n_seqs`` space of ``schedule.grid`` (thd: program slots x
    heads x 1): its ``(row tile, head, sequence)``, its sequence's base rows and lengths
    ``(q_base, sq, k_base, sk)``, and the KV blocks ``(lo, hi)`` its rows see. The heads of one row
    tile are consecutive (a GQA group's programs read the same K/V tiles at about the same time);
    causal row tiles run from the last (the most keys) to the first, so the short ones fill in at
    the end."""
    per_row_tile = heads * n_seqs
    slot = (m_tiles - 1 - i // per_row_tile) if causal else i // per_row_tile
    head = i % per_row_tile % heads
    b, bx = locate(layout, CuQ, slot, i % per_row_tile // heads, bm)
    q_base, sq = sequence(layout, CuQ, b, seq_q)
    k_base, sk = sequence(layout, CuK, b, seq_kv)
    lo, hi = kv_blocks_for_rows(bx * bm, bm, bn, sq, sk, window, causal)
    return bx, head, b, q_base, sq, k_base, sk, lo, hi


@T.macro
def _load_q(Q, layout: str, b, head, q_base, bx, q_s, q_full, q_empty, q_done, q_slots: int, bm: int, pack,
            groups: int, dim: int):
    """The producer's load of a query tile's Q into the slot of the ``q_done``-th tile, once the consumers
    have released it: one box, or (``pack``) one box of ``pack`` rows per head of the group."""
    T.mbarrier_wait_parity(_q_slot(q_empty, q_done, q_slots), _q_phase(q_done, q_slots) ^ 1)
    if pack is None:
        T.tma_copy(tile(Q, layout, b, head, q_base + bx * bm, bm), _q_slot(q_s, q_done, q_slots),
                   barrier=_q_slot(q_full, q_done, q_slots))
    else:  # the group's heads, one box of `pack` rows each
        for g in T.unroll(groups):
            if dim == 64:
                T.tma_copy(tile(Q, layout, b, head * groups + g, q_base + bx * pack, pack),
                           _q_rows(q_s, q_done, q_slots, g * pack, pack),
                           barrier=_q_slot(q_full, q_done, q_slots))
            else:  # one box per 64 columns: a [pack, 128] box of the swizzled buffer is
                # no bijection for TileLang 0.1.15's TMA lowering, its 64-column halves are
                for hc in T.unroll(dim // 64):
                    T.tma_copy(tile(Q, layout, b, head * groups + g, q_base + bx * pack, pack, hc * 64, 64),
                               _q_rows(q_s, q_done, q_slots, g * pack, pack, hc * 64, 64),
                               barrier=_q_slot(q_full, q_done, q_slots))
    T.barrier_arrive(_q_slot(q_full, q_done, q_slots))


@T.macro
def _keep_p(acc_s, p, p_lo, bm: int, bn: int, o32: bool):
    """The tile's probabilities as the next PV product's A operand: rounded once, or (``o32``) as
    ``hi + lo`` (``split.py``)."""
    if o32:
        two_terms(acc_s, p, p_lo, bm, bn)
    else:
        T.copy(acc_s, p)


@T.macro
def _pingpong_start(wg):
    """The first warpgroup's turn is given before the loop (FlashAttention-3's scheduler barriers:
    warpgroup ``w`` syncs on barrier ``PINGPONG_BARRIER + w`` and, once its products are issued,
    arrives on the next one's)."""
    if wg == 0:
        T.named_barrier_arrive(PINGPONG_BARRIER, 256)
