"""The forward, warp-specialized by hand for Hopper (FlashAttention-3's schedule).

Same outputs and arguments as ``fwd.build_fwd`` (o and lse bitwise equal, docs/perf-log.md v9), a
different schedule: a persistent grid of programs looping over the (row tile, head, sequence) tiles,
each with ``block_m / 64`` consumer warpgroups (each owns 64 query rows of the tile) and one producer
warpgroup:

- the **producer** (24 registers) loads the tile's Q once and each K and V tile by TMA into a
  ring of ``stages`` slots, K and V with barriers of their own, so a consumer starts QK^T as soon
  as K has landed;
- each **consumer** overlaps the softmax of one KV tile with the tensor cores' work on its
  neighbours (FlashAttention-3's intra-warpgroup overlap): it issues S_j = Q K_j^T and
  O += P_{j-1} V_{j-1} back to back as asynchronous wgmma, waits for S_j only, computes the
  softmax of S_j while P_{j-1} V_{j-1} runs, then waits for that, rescales O and keeps P_j in
  registers (the A operand of the next PV product).

TileLang's automatic warp specialization (``T.Pipelined`` in ``fwd.py``) waits for every product
(``T.gemm``), so the softmax and the two GEMMs of one warpgroup never overlap.

Masking as ``fwd.py``'s ``"branch"``: only the KV tiles that are not wholly visible
(``block_range.full_kv_blocks_for_rows``) evaluate the per-element mask.
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from . import softmax
from .block_range import full_kv_blocks_for_rows, kv_blocks_for_rows
from .config import KernelConfig, Tiles, pack_gqa_fits
from .fwd_entry import fwd_entry, fwd_shapes
from .layout import sequence, store_rows, store_rows_vec, store_stat, tile, tile_head, tile_row
from .mask import branch_logits
from .schedule import locate, persistent_steps, persistent_tile
from .split import split as two_terms

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
#: (``epilogue="wg"``; one per consumer warpgroup, after the scheduler barriers)
STORE_BARRIER = 8


def consumer_regs(n_consumers: int, per_sm: int = 1) -> int:
    """setmaxnreg of each consumer warpgroup: what the producer leaves of its program's registers,
    rounded down to a multiple of 8 and at most 240. The register file is 64K 32-bit registers per SM;
    with ``per_sm`` programs on an SM, a program is launched with its share rounded down to 8 a thread
    (``__launch_bounds__``'s minimum blocks), and setmaxnreg only moves registers within that pool."""
    launch = 65536 // (per_sm * 128 * (n_consumers + 1)) // 8 * 8
    left = (launch * 128 * (n_consumers + 1) - 128 * PRODUCER_REGS) // (128 * n_consumers)
    return min(240, left // 8 * 8)


def build_fwd_ws(cfg: KernelConfig, t: Tiles, ctas: int | None = PERSISTENT_CTAS, pingpong: bool = True,
                 fold: bool = False, fma_every: int = 0, o32: bool = False, epilogue: str = "smem",
                 q_slots: int = 1, pack_gqa: bool = False, wg_ranges: bool = False, pin_wait: bool = False,
                 mask_limits: bool = False, lazy_rescale: float = 0.0, snake: bool = True,
                 q_ahead: bool = False, chain: bool = False, per_sm: int = 1, sink_early: bool = False):
    """The warp-specialized forward for tiles ``t``: ``t.block_m`` a multiple of 64 (one consumer
    warpgroup per 64 rows, ``t.threads`` their threads, ``block_m * 2``; the kernel runs 128 more,
    the producer's), ``t.stages`` ring slots for K and V.

    ``ctas``: a persistent grid of at most that many programs, each looping over its tiles of the
    (row tile, head, sequence) space (one per round of ``ctas`` tiles: ``snake``), the causal row tiles longest
    first, so the producer loads a tile's Q, K and V while the consumers finish the previous one
    and no program pays a launch and an empty pipeline per tile; None: one program per tile.

    ``snake`` (the default; False for tools/fwd_variants.py's "/rr" rows): the persistent programs take
    every other round of tiles in reverse (``schedule.persistent_tile``), so the programs that take a
    round's longest causal tiles take the next round's shortest; round-robin left the first programs
    ~4-6% more work than the mean on gpt-oss's causal problems (a model, the function's docstring).
    Measured on an H100 in one run (docs/perf-log.md v23): causal D128 N4096 0.5159 -> 0.4962 ms, causal D64
    N8192 1.2433 -> 1.2117, windowed problems unchanged; o and lse bitwise the same.

    ``per_sm`` (an option for tools/fwd_variants.py): programs an SM, the persistent grid ``ctas * per_sm``
    (``__launch_bounds__``' minimum blocks, and setmaxnreg within each program's share of the registers):
    one program's row-tile chain (the wait for Q, the first softmax, the last P V, the epilogue) would
    run while another's products have the tensor cores. ptxas allocates the whole kernel at the launch
    bound, not at the consumers' setmaxnreg, so only one consumer warpgroup a program fits at two (128
    registers; two consumers get 80 and spill). Measured on an H100 in two runs (docs/perf-log.md v26): gpt-oss
    SWA's 64x64 tiles at two an SM 0.0674-0.0697 ms against the windowed kind's 0.0646-0.0652 (192x64,
    one an SM); golden at 64x64 0.1296 against 0.0880-0.0884.

    ``pingpong``: the consumer warpgroups take turns to issue their products (FlashAttention-3's
    scheduler barriers), so one's softmax runs while the other's GEMMs have the tensor cores.

    ``fold``: the scale folded into the exponent's FMA (``softmax.update``'s ``scale_log2``; needs a
    positive scale: ``config.fwd_fold``, and the kind ``fwd_unfolded`` for the others).

    ``fma_every`` (an option for tools/fwd_variants.py; measured 14-30% slower, docs/perf-log.md v13: the
    forward is bound by issue slots, not the MUFU): one column group of 8 in every
    ``fma_every`` takes its exponentials on the FMA pipe (``softmax.exp2_fma``), the others on the MUFU:
    at head dim 64 a tile's 8192 exponentials per consumer take the MUFU (16 per cycle per SM) about as
    long as its products take the tensor cores.

    ``o32`` (strict's training forward, the kind ``fwd_o32``: ``config.fwd_o32``): P @ V as two-term
    products (``split.py``: P = hi + lo, two wgmma per KV tile), and the
    normalized output also written in fp32 to one more output, ``O32``, from which strict's backward
    takes Delta = rowsum(dO * O) in a memory-bound pass (``bwd.build_preprocess(o32=True)``) instead of
    recomputing P and dP. Why two terms: with P rounded once, that Delta moves dsink off the precision
    standard (float64 emulation, fp16 D64 N1024: dsink relative L2 1.7e-3, 2 of 4 heads outside the
    tolerance); with two, dsink's error is 1e-7 to 3e-6, as with the exact Delta (docs/perf-log.md v13).

    ``epilogue`` (``config.fwd_ws_options``: "regs" at head dim 64, "wg" at 128 and in the windowed kind
    ``fwd_window``, "smem" elsewhere): "smem" stages each tile's o in
    shared memory between two barriers of every consumer thread, then stores it row by row; "regs"
    stores o from each thread's registers (cast to the input dtype), so the consumer warpgroups never
    wait for each other at a tile's end. With 2-3 KV tiles per query tile (windows of 128 keys) that
    wait, twice per tile, realigns the ping-pong's two warpgroups at every tile (docs/perf-log.md v14, measured in v15).

    ``epilogue="wg"``: each consumer warpgroup stages its own 64 rows of o in shared memory between two
    barriers of its own 128 threads (``STORE_BARRIER + wg``; the warpgroups never wait for each other),
    then stores them 16 bytes a thread (``layout.store_rows_vec``): whole rows per warp, where "regs"
    writes 4 bytes of a row a store, half a 32-byte sector, and queues 16 stores a thread per tile. ncu
    on gpt-oss SWA's windowed kernel (docs/perf-log.md v24): 48% of the kernel's L2 sectors were those
    halves, and the stores' queue held up the next tile's first instructions. Measured on an H100 in one
    run (tools/fwd_variants.py, docs/perf-log.md v24), o and lse bitwise the same: SWA's windowed kernel
    0.0783 -> 0.0659 ms (from "regs"), golden's 0.1107 -> 0.0956 (from "smem"), causal D128 the same, causal
    D64 N8192 1.2370 -> 1.2645 (from "regs", which it keeps).

    ``epilogue="tma"`` (built in docs/perf-log.md v26, measured in v27; the kind ``fwd_window``'s epilogue in padded
    layouts since v28, ``config.fwd_ws_options``): as
    "wg", but one thread of each consumer warpgroup stores its staged rows by TMA (boxes of 8 rows and 64
    columns, ``_store_o_tma``) after a proxy fence, and waits for the stores to have read the buffer only
    before the next tile's rows are written there. The 128 threads then queue no global stores at all: v24's
    profile had the stores' queue holding up the next tile's first instructions. Padded layouts only (a box
    clips at the tensor's end, not at a packed batch's sequence boundary).

    ``q_slots`` (``config.fwd_ws_options``: 2 at head dim 64, 1 at 128): 2 gives Q a second buffer, so
    the producer loads the next query tile's Q while the consumers still compute on this one's; with
    one, the next Q is loaded only once both consumer warpgroups have issued this tile's last S
    product, and its latency falls on the tile boundary (short tiles: windows). 3: a third buffer, for
    ``q_ahead``.

    ``q_ahead``: the producer loads the next tile's Q before this tile's K and V (the first tile's before
    its loop), where otherwise it comes after them: with few KV tiles per query tile (windows) the ring
    then holds the producer back until the consumers are nearly through the tile, and the next Q lands
    late (ncu, docs/perf-log.md v24: the consumers' wait for Q was the largest single stall of the SWA
    kernel's tile prologue). With two slots the load waits for the previous tile's last S product; with
    three, for the one before that. An option for tools/fwd_variants.py: measured slower (H100, v24, against
    the "wg" epilogue without it): SWA's windowed kernel 0.0659 -> 0.0717 ms with two slots, 0.0671 with
    three (not profiled; a guess: the early load holds back the producer's K/V loads of this tile).

    ``chain`` (an option for tools/fwd_variants.py, docs/perf-log.md v25; measured slower on an H100 in v26:
    gpt-oss SWA's windowed kernel 0.0651 -> 0.0708 ms, golden's 0.0961 -> 0.1124, causal D64 N8192 1.2060
    -> 1.2952, o and lse off the tool's reference by the same amounts as the default's): the persistent
    consumers' row tiles run back to back. A tile's last P V product is not issued at its end but with the
    next tile's first S product, in that tile's ping-pong turn; the next tile's first softmax then runs
    while it computes, and only after that is the tile finished (its maximum and normalizer set aside
    for it, normalized, stored). Without it each tile starts with a softmax that nothing overlaps and
    ends waiting for its last product, once per row tile; v24's profile of gpt-oss SWA put ~650 of its
    7,763 samples in the first tile's softmax, and 55% of that kernel's time is per row tile. One more
    step at the end issues the last tile's pending product alone, as a tile without keys does. The
    pending product is issued on every tile's first step, with nothing pending too (a program's first
    tile, or after a tile without keys: its sum is then dropped), because ptxas keeps the wgmma pipeline
    asynchronous only where each wait follows its products unconditionally (with the product under a
    condition it reported C7514 and serialized them). Not with ``o32`` (its second term) or
    ``wg_ranges``. The turns per tile are unchanged, and the pending V's slot is released by the next
    tile's first step, which waits for nothing the producer loads after it (K and V have rings of their
    own, so this holds with one slot too): tests/test_ws_protocol.py replays the protocol. gpt-oss SWA's windowed kernel (bshd): 128
    registers, no spills, like the default.

    ``pack_gqa`` (``config.fwd_ws_options``: on at head dim 64 where ``config.pack_gqa_fits``, measured
    on the H200, docs/perf-log.md v18, and at 128 in the windowed kind ``fwd_window``, v19;
    FlashAttention-4's default on Hopper): a tile holds the ``groups`` query heads of one KV head, ``block_m / groups`` positions of
    each, head after head (row ``i``: head ``h0 + i // P``, position ``p0 + i % P``), so one K/V tile
    serves the whole group. Under a narrow window a tile then spans fewer keys: at W=128 and 192 rows
    of 8 heads, 24 positions see 151 keys (2-3 KV tiles of 128) where 192 positions see 319 (3),
    ~29% fewer products and softmax passes per row (docs/perf-log.md v15). Padded layouts; ``groups``
    must divide ``block_m`` into whole 8-row groups (the shared-memory swizzle's atom). The tiles run
    over the statistics' padded rows, so every lse row (padding included) is written as without it.
    Packed batches (thd) pack the same way: the varlen tile scheduler (``schedule.py``) hands out
    tiles of ``P`` positions of one sequence, so a short sequence's last tile also wastes fewer rows.
    Head dims 64 and 128 (``_pack_rows``; at 128 a head's rows are two boxes, one per 64-column half).

    ``wg_ranges`` (an option for tools/fwd_variants.py, not measured yet): each consumer warpgroup runs
    only over the KV tiles its own 64 rows see, a contiguous run inside the tile's range, and releases
    the others' slots as they land (it still takes its ping-pong turn on each, so the turns stay
    paired). Under a window the tile's range is the union of its warpgroups' ranges: with 64-key
    tiles at W=128 a 64-row warpgroup sees 3 KV tiles (192 keys per row) where a 128-row tile spans
    4 and a 192-row tile 5, so the products and softmax passes per row fall by a quarter (golden's
    128x64) and by two fifths (gpt-oss's 192x64), against 256 and 384 keys per row with 128-key
    tiles. Not with ``pack_gqa`` (a packed tile's warpgroups see the same keys) or ``o32``.

    ``pin_wait``: each KV tile's softmax ends with a shared-memory store of its normalizer ``l``
    (:func:`_pin`), placed before the wait for the previous tile's P V product. ptxas schedules a
    ``wgmma.wait_group`` (SASS ``WARPGROUP.DEPBAR``) as early as its basic block allows, and nothing in
    the softmax depends on it, so without the store it hoists the wait to the top of the softmax's block,
    right after the mask: the tile's row maximum, exponentials and sums then run after P V has finished
    instead of beside it, which undoes the intra-warpgroup overlap above (cuobjdump -sass of the sm_90a
    cubins, every forward kind, docs/perf-log.md v20). It keeps shared-memory stores before the wait, and the
    store needs ``l``, the last value of the softmax's chain. Off by default: measured slower
    (``config.FWD_PIN_WAIT`` has the numbers).

    ``mask_limits`` (on by default, ``config.FWD_MASK_LIMITS`` has the measurement): a masked tile's logits by
    each row's key limits, worked out once per row (``mask.limit_logits``), instead of the visibility
    test per element (``mask.mask_logits``): the same slots masked, fewer instructions per logit; most
    of a narrow window's tiles are masked ones.

    ``lazy_rescale`` (> 0, an option for tools/fwd_variants.py): the softmax's pivot moves only where a
    row's maximum exceeds it by more than ``2**lazy_rescale`` (``softmax.new_max(lazy=..)``), and a warp
    skips the output's rescale when none of its rows moved (``softmax.rescale``'s ``need``): after a row's
    first tiles most tiles skip ``dim_v / 2`` multiplies per thread on the path between one tile's P V
    product and the next. FlashAttention-4's conditional rescaling (it uses 8). Not with ``o32``. With
    ``pin_wait`` it made up what the pin cost (docs/perf-log.md v21); without it, against the library's
    options (v23, H100, one run), it loses: causal D64 N8192 1.2117 -> 1.2603 ms, causal D128 N4096 0.4962 ->
    0.5016; o within one more rounding (bf16 relative L2 ~3e-3 against the exact pivot's ~1e-3 between
    tilings). So it stays an option.

    ``sink_early`` (an option for tools/fwd_variants.py, measured within the runs' spread, docs/perf-log.md v29:
    gpt-oss SWA at 256 rows 0.0556 -> 0.0562 ms, golden 0.0852 -> 0.0845, causal D64 1.1950 -> 1.1956, five
    passes round-robin on an H100): a row tile's sink logits loaded at
    its start and turned into the softmax's state only after the wait for Q (``softmax.load_sinks``,
    ``softmax.init_from``), where :func:`softmax.init_state` loads and uses them before that wait. ncu on gpt-oss
    SWA's windowed kernel (docs/perf-log.md v28, call 6): the multiply by log2(e) right after the load held 1.5% of
    the samples on the long scoreboard, once a row tile. Not with ``chain`` or ``wg_ranges``."""
    if lazy_rescale < 0:
        raise ValueError(f"lazy_rescale must be 0 (off) or a positive threshold in base 2, got {lazy_rescale!r}")
    if lazy_rescale and o32:
        raise ValueError("lazy_rescale cannot be combined with o32 (strict's forward keeps the exact maximum)")
    if wg_ranges and (pack_gqa or o32):
        raise ValueError("wg_ranges=True cannot be combined with pack_gqa or o32 (a packed tile's warpgroups see "
                         "the same keys; o32's two-term products are not scheduled per warpgroup)")
    if q_slots not in (1, 2, 3):
        raise ValueError(f"q_slots must be 1, 2 or 3, got {q_slots!r}")
    if q_ahead and q_slots < 2:
        raise ValueError("q_ahead=True needs q_slots of 2 or 3 (with one slot the next tile's Q would wait for this "
                         "tile's last S product, which waits for K tiles the producer has not loaded yet)")
    if chain and (o32 or wg_ranges):
        raise NotImplementedError(f"chain=True supports the single-term forward over one KV range per tile (not o32's "
                                  f"second P V term, not wg_ranges' per-warpgroup ranges); got o32={o32}, "
                                  f"wg_ranges={wg_ranges}")
    if not isinstance(per_sm, int) or per_sm < 1 or consumer_regs(t.block_m // ROWS_PER_CONSUMER or 1, per_sm) < 64:
        raise ValueError(f"per_sm must be a whole number of programs an SM that leaves the consumers at least 64 "
                         f"registers a thread; got {per_sm!r} with {t.block_m}-row tiles")
    if sink_early and (chain or wg_ranges):
        raise NotImplementedError(f"sink_early=True supports the forward's one tile at a time over one KV range (not "
                                  f"chain, not wg_ranges); got chain={chain}, wg_ranges={wg_ranges}")
    if epilogue not in ("smem", "regs", "wg", "tma"):
        raise ValueError(f"epilogue must be 'smem', 'regs', 'wg' or 'tma', got {epilogue!r}")
    if epilogue == "tma" and (cfg.layout == "thd" or chain or o32 or cfg.head_dim_v % 64):
        raise NotImplementedError(f"epilogue='tma' stores o by TMA in padded layouts (bshd, bhsd: a box clips at the "
                                  f"sequence's end, a packed batch's next sequence would not be), value head dims "
                                  f"of multiples of 64, without chain or o32; got {cfg.short()}, chain={chain}, o32={o32}")
    if epilogue == "wg" and cfg.head_dim_v % 16:
        raise NotImplementedError(f"epilogue='wg' stores a warpgroup's 64 rows 16 bytes a thread, 128 threads at a time: "
                                  f"value head dims that are multiples of 16; got {cfg.head_dim_v}")
    if o32 and cfg.precision != "strict":
        raise ValueError(f"o32=True is strict's forward (two-term P @ V, fp32 O for the backward); got {cfg.short()}")
    if not cfg.hopper or t.block_m % ROWS_PER_CONSUMER or t.stages < 1:
        raise NotImplementedError(f"the warp-specialized forward supports Hopper (sm_90a) and query tiles of a "
                                  f"multiple of {ROWS_PER_CONSUMER} rows; got {cfg.short()}, {t}")
    bm, bn, stages = t.block_m, t.block_n, t.stages
    pack = _pack_rows(cfg, bm) if pack_gqa else None
    rows = bm if pack is None else pack  # query positions per tile
    n_consumers = bm // ROWS_PER_CONSUMER
    consumers = 128 * n_consumers
    regs = consumer_regs(n_consumers, per_sm)
    dim, dim_v, groups, layout = cfg.head_dim, cfg.head_dim_v, cfg.groups, cfg.layout
    dtype, accum = cfg.dtype, "float32"
    shapes = fwd_shapes(cfg)
    heads, seq_q, seq_kv = shapes.heads, shapes.seq_q, shapes.seq_kv

    @T.macro
    def body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, m_tiles, n_seqs, O32=None):
        total = _row_tiles(m_tiles, LSE, layout, pack) * _units(heads, groups, pack) * n_seqs
        n_ctas = total if ctas is None else T.min(total, ctas * per_sm)
        with T.Kernel(n_ctas, threads=consumers + 128) as cta:
            if per_sm > 1:
                T.annotate_min_blocks_per_sm(per_sm)
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
            m = T.alloc_fragment([bm], accum)
            m_prev = T.alloc_fragment([bm], accum)
            alpha = T.alloc_fragment([bm], accum)
            row_sum = T.alloc_fragment([bm], accum)
            l = T.alloc_fragment([bm], accum)
            lse = T.alloc_fragment([bm], accum)
            early = sink_early and cfg.has_sinks
            sink_r = T.alloc_fragment([bm], accum) if early else None  # the tile's sink logits, loaded ahead
            l_pin = T.alloc_shared([bm], accum) if pin_wait else None  # written, never read: _pin
            need = T.alloc_local([1], "int32") if lazy_rescale > 0 else None  # softmax.rescale's vote (lazy_rescale)
            # mask_limits: each row's last visible and last hidden key, relative to the tile's first
            if mask_limits:
                key_hi = T.alloc_fragment([bm], "int32")
                key_lo = T.alloc_fragment([bm], "int32")
                limits = (key_hi, key_lo)
            else:
                limits = None
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
            if wg_ranges:  # a consumer warpgroup's own KV tiles and wholly visible ones, per query tile
                own_lo = T.alloc_var("int32")
                own_hi = T.alloc_var("int32")
                own_flo = T.alloc_var("int32")
                own_fhi = T.alloc_var("int32")
            if chain:
                # the pending tile (a consumer's): its output waits for its last P V, issued with the next tile's
                # first S, and for its epilogue, after that tile's first softmax; one more step flushes the last
                pend = T.alloc_var("int32", init=0)  # a tile's output is pending
                pend_pv = T.alloc_var("int32", init=0)  # ... and its last P V is not issued yet
                p_b = T.alloc_var("int32", init=0)
                p_head = T.alloc_var("int32", init=0)
                p_q_base = T.alloc_var("int32", init=0)
                p_row0 = T.alloc_var("int32", init=0)
                p_sq = T.alloc_var("int32", init=0)
                m_pend = T.alloc_fragment([bm], accum)
                l_pend = T.alloc_fragment([bm], accum)
            tx = T.get_thread_binding()
            wg = tx // 128  # the consumer warpgroup


            if tx >= consumers:
                T.set_max_nreg(PRODUCER_REGS, 0)
                steps = persistent_steps(cta, total, n_ctas, snake)
                for step in T.serial(steps):
                    if q_ahead:
                        # the next tile's Q before this tile's K and V (at the first step, the first tile's too)
                        for j in T.serial(1 + (step == 0)):
                            q_step = step + j + (step > 0)
                            if q_step < steps:
                                bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                                    persistent_tile(cta, q_step, n_ctas, snake), _row_tiles(m_tiles, LSE, layout, pack),
                                    _units(heads, groups, pack),
                                    n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                                if hi > lo:
                                    _load_q(Q, layout, b, head, q_base, bx, q_s, q_full, q_empty, q_done, q_slots, bm,
                                            pack, groups, dim)
                                    q_done = q_done + 1
                    bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                        persistent_tile(cta, step, n_ctas, snake), _row_tiles(m_tiles, LSE, layout, pack),
                        _units(heads, groups, pack),
                        n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                    kv_head = head // groups if pack is None else head
                    # a tile that visits no keys loads nothing (its consumers wait for nothing)
                    if not q_ahead:
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
                if pingpong:
                    _pingpong_start(wg)
                if chain:  # nothing is pending at the first step: the state it sets aside is never read
                    T.fill(acc_o, 0)
                    T.fill(p, 0)
                    T.fill(m, 0)
                    T.fill(l, 0)
                if chain:
                    steps = persistent_steps(cta, total, n_ctas, snake)  # (then one more step, the flush)
                for step in T.serial(steps + 1 if chain else persistent_steps(cta, total, n_ctas, snake)):
                    if chain:
                        if step < steps:
                            bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                                persistent_tile(cta, step, n_ctas, snake), _row_tiles(m_tiles, LSE, layout, pack),
                                _units(heads, groups, pack),
                                n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                        else:  # the flush: no tile, no keys
                            lo = 0
                            hi = 0
                    else:
                        bx, head, b, q_base, sq, k_base, sk, lo, hi = _locate(
                            persistent_tile(cta, step, n_ctas, snake), _row_tiles(m_tiles, LSE, layout, pack),
                            _units(heads, groups, pack),
                            n_seqs, CuQ, CuK, seq_q, seq_kv, window, rows, bn, layout, cfg.causal)
                    row0 = bx * rows  # the tile's first query position
                    flo, fhi = full_kv_blocks_for_rows(lo, hi, row0, rows, bn, sq, sk, window, cfg.causal)
                    n = hi - lo
                    if not chain:
                        T.fill(acc_o, 0)
                        if early:  # the load now, its use after the wait for Q (sink_early)
                            softmax.load_sinks(sink_r, Sinks, _first_head(head, groups, pack), bm, pack)
                        else:
                            softmax.init_state(m, l, Sinks, _first_head(head, groups, pack), bm, cfg.has_sinks, pack)
                    if wg_ranges:
                        # each consumer warpgroup only over the KV tiles its own 64 rows see (a contiguous run of
                        # the tile's [lo, hi)); it still takes its ping-pong turn and releases every slot of the others
                        own_lo, own_hi = kv_blocks_for_rows(row0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER, bn, sq, sk, window,
                                                            cfg.causal)
                        own_flo, own_fhi = full_kv_blocks_for_rows(own_lo, own_hi, row0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER,
                                                                   bn, sq, sk, window, cfg.causal)
                        if n > 0:
                            T.mbarrier_wait_parity(_q_slot(q_full, q_done, q_slots), _q_phase(q_done, q_slots))
                        for it in T.serial(n):
                            kb = lo + it
                            c = kv_done + it
                            s = c % stages
                            sp = (c - 1) % stages
                            live = (kb >= own_lo) & (kb < own_hi)
                            with_pv = live & (kb > own_lo)  # the previous tile's P V, issued with this S
                            T.mbarrier_wait_parity(k_full[s], (c // stages) & 1)
                            if with_pv:
                                T.mbarrier_wait_parity(v_full[sp], ((c - 1) // stages) & 1)
                            if pingpong:
                                T.sync_threads(PINGPONG_BARRIER + wg, 256)
                            if live:
                                T.wgmma_gemm(_q_slot(q_s, q_done, q_slots), k_r[s, :, :], acc_s, transpose_B=True,
                                             clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                                if with_pv:
                                    T.wgmma_gemm(p, v_r[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                            if pingpong:
                                T.named_barrier_arrive(PINGPONG_BARRIER + (wg + 1) % n_consumers, 256)
                            if live:
                                if with_pv:
                                    T.wait_wgmma(1)  # S; the previous P V still runs
                                else:
                                    T.wait_wgmma(0)
                                T.barrier_arrive(k_empty[s])
                                branch_logits(acc_s, row0, kb * bn, sq, sk, window, scale_log2, fold, (own_flo, own_fhi), kb,
                                              cfg.causal, None, limits)
                                softmax.new_max(acc_s, m, m_prev, alpha, row_sum, bm, scale_log2 if fold else None, lazy_rescale)
                                softmax.exp_sum(acc_s, m, alpha, row_sum, l, bm, bn, scale_log2 if fold else None, fma_every)
                                if with_pv:
                                    _pin(l, l_pin)
                                    T.wait_wgmma(0)
                                    T.barrier_arrive(v_empty[sp])
                                    softmax.rescale(acc_o, alpha, bm, dim_v, need)
                                _keep_p(acc_s, p, p_lo, bm, bn, o32)
                                if kb == own_hi - 1:
                                    # this warpgroup's last tile: its P V now, so that its V slot is free before the
                                    # skipped tiles after it (more of them than ring slots would otherwise wait for it)
                                    T.mbarrier_wait_parity(v_full[s], (c // stages) & 1)
                                    T.wgmma_gemm(p, v_r[s, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                                    T.wait_wgmma(0)
                                    T.barrier_arrive(v_empty[s])
                            else:  # a tile none of this warpgroup's rows sees: released as soon as it has landed
                                T.barrier_arrive(k_empty[s])
                                T.mbarrier_wait_parity(v_full[s], (c // stages) & 1)
                                T.barrier_arrive(v_empty[s])
                        if n > 0:
                            T.barrier_arrive(_q_slot(q_empty, q_done, q_slots))
                            q_done = q_done + 1
                    else:
                        if n > 0:
                            T.mbarrier_wait_parity(_q_slot(q_full, q_done, q_slots), _q_phase(q_done, q_slots))
                            if early:
                                softmax.init_from(m, l, sink_r, bm)
                            # the first KV tile: S_0, its softmax, P_0 kept for the next step's PV product
                            s0 = kv_done % stages
                            T.mbarrier_wait_parity(k_full[s0], (kv_done // stages) & 1)
                            if chain:
                                if pend_pv != 0:  # the pending tile's last V: the KV tile just before this one
                                    T.mbarrier_wait_parity(v_full[(kv_done - 1) % stages], ((kv_done - 1) // stages) & 1)
                            if pingpong:
                                T.sync_threads(PINGPONG_BARRIER + wg, 256)  # this warpgroup's turn
                            T.wgmma_gemm(_q_slot(q_s, q_done, q_slots), k_r[s0, :, :], acc_s, transpose_B=True,
                                         clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                            if chain:
                                # the pending P V, issued even when there is none (the program's first tile, or
                                # after a tile without keys): its sum is dropped with acc_o below, and ptxas can only
                                # keep the products asynchronous where each wait follows its products unconditionally
                                T.wgmma_gemm(p, v_r[(kv_done - 1) % stages, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                            if pingpong:
                                T.named_barrier_arrive(PINGPONG_BARRIER + (wg + 1) % n_consumers, 256)  # the next's
                            if chain:
                                T.wait_wgmma(1)  # S_0; the pending P V still runs
                            else:
                                T.wait_wgmma(0)
                            T.barrier_arrive(k_empty[s0])
                            if chain:  # the pending tile's m and l aside, this tile's from its sink
                                _set_aside(m, l, m_pend, l_pend, bm)
                                softmax.init_state(m, l, Sinks, _first_head(head, groups, pack), bm, cfg.has_sinks, pack)
                            branch_logits(acc_s, row0, lo * bn, sq, sk, window, scale_log2, fold, (flo, fhi), lo,
                                          cfg.causal, pack, limits)
                            softmax.new_max(acc_s, m, m_prev, alpha, row_sum, bm, scale_log2 if fold else None, lazy_rescale)
                            softmax.exp_sum(acc_s, m, alpha, row_sum, l, bm, bn, scale_log2 if fold else None, fma_every)
                            if not chain:
                                _keep_p(acc_s, p, p_lo, bm, bn, o32)
                        if chain:
                            if n <= 0:  # no S to pair it with: the pending P V alone (no turn, as a last P V)
                                if pend_pv != 0:
                                    T.mbarrier_wait_parity(v_full[(kv_done - 1) % stages], ((kv_done - 1) // stages) & 1)
                                    T.wgmma_gemm(p, v_r[(kv_done - 1) % stages, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                                _set_aside(m, l, m_pend, l_pend, bm)
                                if step < steps:
                                    softmax.init_state(m, l, Sinks, _first_head(head, groups, pack), bm, cfg.has_sinks,
                                                       pack)
                            # the pending P V (nothing without one): unconditional, because ptxas cannot pair a
                            # wait under a condition with the product's, and serializes every wgmma otherwise
                            T.wait_wgmma(0)
                            if pend_pv != 0:
                                T.barrier_arrive(v_empty[(kv_done - 1) % stages])
                            _drop_unless(acc_o, pend_pv, bm, dim_v)  # a pending tile without keys outputs zeros
                            if pend != 0:  # the pending tile's output: normalized and stored
                                softmax.finalize(acc_o, m_pend, l_pend, lse, bm, dim_v)
                                if epilogue == "wg":
                                    T.sync_threads(STORE_BARRIER + wg, 128)
                                    T.copy(acc_o, o_s)
                                    T.sync_threads(STORE_BARRIER + wg, 128)
                                    store_rows_vec(O, layout, p_b, _first_head(p_head, groups, pack), p_q_base, p_row0,
                                                   p_sq, o_s, wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER, dim_v,
                                                   tx % 128, 128, pack)
                                elif epilogue == "smem":
                                    T.copy(acc_o, o_s)
                                    T.sync_threads(CONSUMER_BARRIER, consumers)
                                    store_rows(O, layout, p_b, _first_head(p_head, groups, pack), p_q_base, p_row0, p_sq,
                                               o_s, bm, dim_v, pack)
                                    T.sync_threads(CONSUMER_BARRIER, consumers)
                                else:
                                    T.copy(acc_o, o_r)
                                    store_rows(O, layout, p_b, _first_head(p_head, groups, pack), p_q_base, p_row0, p_sq,
                                               o_r, bm, dim_v, pack)
                                store_stat(LSE, layout, p_b, _first_head(p_head, groups, pack), p_q_base, p_row0, p_sq,
                                           lse, bm, pack)
                            T.fill(acc_o, 0)
                            if n > 0:
                                _keep_p(acc_s, p, p_lo, bm, bn, o32)
                        for it in T.serial(1, T.max(n, 1)):
                            c = kv_done + it
                            s = c % stages
                            sp = (c - 1) % stages
                            T.mbarrier_wait_parity(k_full[s], (c // stages) & 1)
                            T.mbarrier_wait_parity(v_full[sp], ((c - 1) // stages) & 1)
                            if pingpong:
                                T.sync_threads(PINGPONG_BARRIER + wg, 256)
                            T.wgmma_gemm(_q_slot(q_s, q_done, q_slots), k_r[s, :, :], acc_s, transpose_B=True,
                                         clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                            T.wgmma_gemm(p, v_r[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                            if o32:
                                T.wgmma_gemm(p_lo, v_r[sp, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                            if pingpong:
                                T.named_barrier_arrive(PINGPONG_BARRIER + (wg + 1) % n_consumers, 256)
                            T.wait_wgmma(2 if o32 else 1)  # S_it; P_{it-1} V_{it-1} still runs
                            T.barrier_arrive(k_empty[s])
                            kb = lo + it
                            branch_logits(acc_s, row0, kb * bn, sq, sk, window, scale_log2, fold, (flo, fhi), kb,
                                          cfg.causal, pack, limits)
                            softmax.new_max(acc_s, m, m_prev, alpha, row_sum, bm, scale_log2 if fold else None, lazy_rescale)
                            softmax.exp_sum(acc_s, m, alpha, row_sum, l, bm, bn, scale_log2 if fold else None, fma_every)
                            _pin(l, l_pin)
                            T.wait_wgmma(0)
                            T.barrier_arrive(v_empty[sp])
                            softmax.rescale(acc_o, alpha, bm, dim_v, need)
                            _keep_p(acc_s, p, p_lo, bm, bn, o32)
                        if n > 0:
                            # every S product read Q: the next tile's may land
                            T.barrier_arrive(_q_slot(q_empty, q_done, q_slots))
                            q_done = q_done + 1
                            last = (kv_done + n - 1) % stages
                            if not chain:  # (chain: the last P V goes with the next tile's first S, or the flush)
                                T.mbarrier_wait_parity(v_full[last], ((kv_done + n - 1) // stages) & 1)
                                T.wgmma_gemm(p, v_r[last, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                                if o32:
                                    T.wgmma_gemm(p_lo, v_r[last, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                                T.wait_wgmma(0)
                                T.barrier_arrive(v_empty[last])
                    kv_done = kv_done + n
                    if chain:  # this tile's output is the next step's to finish
                        pend = T.if_then_else(step < steps, 1, 0)
                        pend_pv = T.if_then_else(n > 0, 1, 0)
                        p_b = b
                        p_head = head
                        p_q_base = q_base
                        p_row0 = row0
                        p_sq = sq
                    if not chain:  # (chain: the next step finishes this tile, above)
                        if early:
                            # a tile without keys: its state here, not before the wait for Q, where ptxas would
                            # predicate the multiply and every tile would wait for the load there
                            if n <= 0:
                                softmax.init_from(m, l, sink_r, bm)
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
def _set_aside(m, l, m_pend, l_pend, bm: int):
    """``chain``: the pending tile's running maximum and normalizer, kept for its epilogue while this
    tile's start from the sink."""
    for i in T.Parallel(bm):
        m_pend[i] = m[i]
        l_pend[i] = l[i]


@T.macro
def _drop_unless(acc_o, keep, bm: int, dim_v: int):
    """``chain``: ``acc_o`` where ``keep`` is nonzero, else zeros (a select, not a branch around a fill)."""
    for i, j in T.Parallel(bm, dim_v):
        acc_o[i, j] = T.if_then_else(keep != 0, acc_o[i, j], 0.0)


@T.macro
def _pin(l, l_pin):
    """``build_fwd_ws``'s ``pin_wait``: the normalizer stored to shared memory (never read back), so that
    ptxas keeps the wait that follows after the softmax that computed it; nothing without the option."""
    if l_pin is not None:
        T.copy(l, l_pin)


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
