"""Split-KV forward against a paged KV cache (``attention_kvcache``: decode and chunked prefill).

The split-KV kernel of ``fwd_split.py`` with the keys read through a block table:

- key ``j`` of batch row ``b`` is row ``j % page_size`` of page ``BlockTable[b, j // page_size]``.
  Each key tile's rows are first resolved to (page, row in the page), once per key and in 32-bit
  integers, into a shared-memory table; the K and V loads then gather their rows through it (V with K,
  one tile ahead into registers, so that their latencies overlap the tile before: ``prefetch``). One kernel serves every page size (a runtime
  value, like the lengths) and a key tile may span several pages. (A tile copy per page would need
  ``page_size`` to be a multiple of the tile and a kernel per page-size class; TMA needs an affine
  tile.) A contiguous cache ``[B, S_max, H_kv, D]`` is the same kernel with B pages of S_max rows and
  the block table ``[[0], [1], ...]``.
- each batch row has its own length, ``SeqLens[b]``, read on the device: one launch serves a batch
  of sequences of different lengths (``seq_q`` new tokens each, the last ``seq_q`` of the row).
- rows are packed query-major, ``p = r * groups + g``: a tile holds all heads of a GQA group for
  consecutive query rows, so each K/V tile is read once per group and a chunk's rows have a tight
  key range.
- only the key tiles that some query row of the tile does not see whole (the rows' last keys, a
  window's leading edge) take the per-element mask; the others are only scaled
  (``block_range.full_kv_blocks_for_rows``, one branch a tile: ``mask.branch_tile``): the gather's key loop 1,452 -> 1,069
  instructions a wholly visible tile (sm_90a SASS, docs/perf-log.md v30).
- checks on the device, instead of on the host (no sync): a length outside ``[0, max_pages *
  page_size]`` gives NaN partials for the whole row (nothing is read); a used page index outside
  ``[0, num_pages)`` is not read: its keys are NaN, so every query row that sees such a key gets
  NaN (o and lse). Nothing is ever read out of bounds.

Partials (fp32 o and natural-log LSE without the sink, one per split) are merged by
``merge_splits.py``.
"""

import dataclasses

import tilelang.language as T

from . import softmax
from .block_range import full_kv_blocks_for_rows, kv_blocks_for_rows
from .config import KernelConfig, split_tiles
from .mask import branch_tile, in_blocks, scale_logits, visible

NAN = float("nan")
#: the table's page of a key row past its batch row's length (loaded as zeros) and of a row whose
#: block-table entry is outside the cache (its keys NaN)
PAST_END, BAD_PAGE = -1, -2


def build_fwd_kvcache(cfg: KernelConfig, prefetch: bool = True, aligned: bool = False, stages: int = 0,
                      branch: bool = True):
    """The kernel. Why the shared page table: when each 16-byte load derived its row's page from the
    block table inside the load's address, the code generator computed it in 64-bit integers (the
    cache's flat index is 64-bit), several 64-bit divisions by ``page_size`` per load, each a called
    routine (sm_90a SASS: 160 call sites; 40 with the table, none in the key loop); that kernel moved
    290-330 GB/s on the H200 against 720-1000 with the table (decode B=8, 4k-64k keys; docs/perf-log.md
    v13), with the same partials bitwise.

    ``prefetch`` (the default): the key loop gathers the next tile's K/V rows into registers before this
    tile's products and softmax, and stores them to shared memory at the next step's start, so the
    gather's loads are in flight while the tile computes. Without it each tile's gather is a plain load
    that the products wait for (``T.Pipelined`` does not make a conditional gather asynchronous:
    TileLang 0.1.15 emits the same code for it, docs/perf-log.md v22), and ``attention_kvcache`` moved
    680-960 GB/s where ``attention``'s split-KV decode moves 1,240-2,520 on the same keys (v23, H100).
    The same gather either way, so the same partials; 64 more registers per thread for the two tiles
    (ptxas: 241 at sm_90a, 187 at sm_80, no spills).

    ``aligned`` (an option for tools/kvcache_variants.py, measured slower, docs/perf-log.md v29): for a page size
    that is a multiple of the key tile (the caller's to ensure; vLLM's and FlashInfer's 16-256 pages against
    D64's 128-key tiles are not all), a key tile wholly below its row's length lies in one page, so it is one
    affine box, ``K[page, off:off + bn, kv_head, :]``, which ``T.Pipelined`` loads asynchronously (TMA on
    Hopper), as ``fwd_split.py`` loads the contiguous tensors; only the page index is read from the block table
    (one scalar a tile). The box of the tile that holds a row's last key ends at that key (its first rows are
    the tile before's keys, masked, or before the page: TMA's zero fill), so no key past the length is read
    (the page's other rows may hold anything: NaN in V would reach o through P = 0). Measured on an H100
    (decode-paged B=8, page 256, the kernel alone at the library's split count; o and lse within 1e-6 of the
    gather's, the same NaN rows, past-length rows and unused pages NaN): 4k 0.0479 -> 0.0576 ms, 16k 0.1420 ->
    0.1579, 64k 0.5097 -> 0.5278 (not profiled; the likely reason: two TMA stages of a warp-specialized program,
    a producer warpgroup beside 240-register consumers, keep fewer bytes in flight an SM than the gather's
    programs, each holding its next tile in registers). A page index outside the cache is not read (page 0 is,
    its logits then NaN, as the gather's NaN keys make them). ``stages`` (with ``aligned``; 0: ``split_tiles``'
    two): the pipeline's TMA stages, more bytes in flight a program (docs/perf-log.md v29, Next 4; not measured yet).
    (The block table's entries of a split read into shared memory before the loop, so that the producer's TMA
    issue waits on shared memory instead of a global load, did not compile: TileLang 0.1.15 ran over 200 s
    on it and was stopped.)

    ``branch`` (the default; False for tools/kvcache_variants.py's "masked" rows): the per-element mask only on the
    key tiles that need it (the module's docstring); False masks every tile, as before docs/perf-log.md v30."""
    if aligned and prefetch:
        raise ValueError("build_fwd_kvcache: aligned=True loads its tiles through T.Pipelined; pass prefetch=False")
    if stages and not aligned:
        raise ValueError(f"build_fwd_kvcache: stages={stages} needs aligned=True (the gather has no pipeline)")
    if stages < 0:
        raise ValueError(f"build_fwd_kvcache: stages must be 0 (the tiles') or positive, got {stages}")
    t = split_tiles(cfg)
    if stages:
        t = dataclasses.replace(t, stages=stages)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups = cfg.head_dim, cfg.head_dim_v, cfg.groups
    dtype, accum = cfg.dtype, "float32"
    batch, heads, seq_q, num_pages, page_size, max_pages, n_splits = T.dynamic(
        "batch, heads, seq_q, num_pages, page_size, max_pages, n_splits"
    )
    heads_kv = heads // groups
    n_rows = groups * seq_q  # packed rows per (batch row, KV head)
    m_tiles = T.ceildiv(n_rows, bm)

    @T.macro
    def logits(acc_s, p0, key0, seq_kv, window, scale_log2, masked: bool):
        """The tile's logits scaled into base 2 and (``masked``: ``mask.branch_tile``'s choice) -inf where a packed
        row (query-major: row ``p0 + i`` is query ``(p0 + i) // groups``) does not see the key, and in the rows past
        the packed ones."""
        if masked:
            for i, j in T.Parallel(bm, bn):
                acc_s[i, j] = T.if_then_else(
                    (p0 + i < n_rows) & visible((p0 + i) // groups, key0 + j, seq_q, seq_kv, window, True),
                    acc_s[i, j] * scale_log2,
                    -T.infinity(accum),
                )
        else:
            scale_logits(acc_s, scale_log2, False)

    @T.macro
    def scores(q_s, k_s, acc_s, p0, key0, seq_kv, window, scale_log2, kb, full):
        """The tile's logits, masked and scaled into base 2: key block ``kb`` in ``full`` (the blocks every
        query row of the tile sees whole) only scaled; rows past the packed ones (q zero) then keep finite
        logits, never stored, never mixed into another row's softmax. ``full`` None: the mask on every tile."""
        T.clear(acc_s)
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        branch_tile(logits, None if full is None else in_blocks(kb, full), acc_s, p0, key0, seq_kv, window,
                    scale_log2)

    @T.macro
    def accumulate(acc_s, p, v_s, acc_o, m, m_prev, alpha, row_sum, l):
        """The logits into the running softmax, and P @ V into o."""
        softmax.update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, bm, bn, dim_v)
        T.copy(acc_s, p)
        T.gemm(p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def resolve(BlockTable, pg_s, off_s, b, key0, seq_kv, page_size, max_pages, num_pages):
        """Each key row of the tile to its page (PAST_END past the row's length: zeros;
        BAD_PAGE for an index outside the cache: NaN keys) and its row in the page, once per key."""
        # the division first, alone in a 32-bit store: inside a global load's index the code generator
        # widens it to 64 bits (a called division routine)
        for r in T.Parallel(bn):
            pg_s[r] = T.truncdiv(key0 + r, page_size)
            off_s[r] = T.truncmod(key0 + r, page_size)
        for r in T.Parallel(bn):
            pg_s[r] = T.if_then_else(
                key0 + r < seq_kv,
                T.if_then_else(_slot_ok(BlockTable, b, pg_s[r], max_pages, num_pages),
                               _slot_entry(BlockTable, b, pg_s[r], max_pages), BAD_PAGE),
                PAST_END,
            )

    @T.macro
    def fetch(BlockTable, K, V, pg_s, off_s, b, kv_head, key0, seq_kv, page_size, max_pages, num_pages, k_to, v_to):
        """The key tile from ``key0``: its rows resolved to pages (``resolve``), then its key and value rows
        gathered into ``k_to`` and ``v_to``: zeros past a row's length, NaN keys from a page outside the cache."""
        resolve(BlockTable, pg_s, off_s, b, key0, seq_kv, page_size, max_pages, num_pages)
        for r, d in T.Parallel(bn, dim):
            k_to[r, d] = T.if_then_else(
                pg_s[r] >= 0, K[pg_s[r], off_s[r], kv_head, d],
                T.if_then_else(pg_s[r] == PAST_END, T.cast(0, dtype), T.cast(NAN, dtype)),
            )
        for r, d in T.Parallel(bn, dim_v):
            v_to[r, d] = T.if_then_else(pg_s[r] >= 0, V[pg_s[r], off_s[r], kv_head, d], T.cast(0, dtype))

    @T.prim_func
    def flashsink_fwd_kvcache(
        Q: T.Tensor([batch, seq_q, heads, dim], dtype),
        K: T.Tensor([num_pages, page_size, heads_kv, dim], dtype),
        V: T.Tensor([num_pages, page_size, heads_kv, dim_v], dtype),
        BlockTable: T.Tensor([batch, max_pages], "int32"),
        SeqLens: T.Tensor([batch], "int32"),
        window: T.int32,
        scale_log2: T.float32,
        OPart: T.Tensor([batch, heads, seq_q, n_splits, dim_v], accum),
        LSEPart: T.Tensor([batch, heads, seq_q, n_splits], accum),
    ):
        with T.Kernel(n_splits * m_tiles, heads_kv, batch, threads=t.threads) as (bx, kv_head, b):
            q_s = T.alloc_shared([bm, dim], dtype)
            k_s = T.alloc_shared([bn, dim], dtype)
            v_s = T.alloc_shared([bn, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)
            p = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            m = T.alloc_fragment([bm], accum)
            m_prev = T.alloc_fragment([bm], accum)
            alpha = T.alloc_fragment([bm], accum)
            row_sum = T.alloc_fragment([bm], accum)
            l = T.alloc_fragment([bm], accum)
            lse = T.alloc_fragment([bm], accum)
            if not aligned:  # the gather's page table
                pg_s = T.alloc_shared([bn], "int32")  # each key row's page (or PAST_END / BAD_PAGE)
                off_s = T.alloc_shared([bn], "int32")  # and its row in the page
            if aligned:  # whether the tile's page is in the cache
                page_ok = T.alloc_local([1], "int32")
            if prefetch:  # the next tile's key and value rows, loaded while this tile computes
                k_r = T.alloc_fragment([bn, dim], dtype)
                v_r = T.alloc_fragment([bn, dim_v], dtype)

            # truncated division (C's / and %) wherever the operands are >= 0: floor division's sign
            # fix-ups are otherwise repeated in every expression that uses the result
            split = T.truncmod(bx, n_splits)
            p0 = T.truncdiv(bx, n_splits) * bm  # first packed row of this tile
            stored = SeqLens[b]
            bad_len = (stored < 0) | (stored > max_pages * page_size)
            seq_kv = T.if_then_else(bad_len, 0, stored)
            # (no Python names for per-element expressions inside T.Parallel: a name becomes a Let
            # binding, which the sm_80 code generator refuses to see bound twice; hence the helpers)
            for r, d in T.Parallel(bm, dim):
                q_s[r, d] = T.if_then_else(
                    p0 + r < n_rows, Q[b, (p0 + r) // groups, kv_head * groups + (p0 + r) % groups, d], T.cast(0, dtype)
                )
            T.fill(acc_o, 0)
            softmax.init_state(m, l, None, 0, bm, False)
            first_row = p0 // groups
            last_row = (T.min(p0 + bm, n_rows) - 1) // groups
            lo, hi = kv_blocks_for_rows(first_row, last_row - first_row + 1, bn, seq_q, seq_kv, window, True)
            # the blocks below the rows' length that every row of the tile sees whole: no per-element mask
            full = (full_kv_blocks_for_rows(lo, hi, first_row, last_row - first_row + 1, bn, seq_q, seq_kv, window, True)
                    if branch else None)
            per = T.ceildiv(hi - lo, n_splits)
            my_lo = T.min(hi, lo + split * per)
            my_hi = T.min(hi, my_lo + per)

            if prefetch:
                # the first tile's rows into registers; each step then stores them to shared memory and
                # issues the next tile's loads before its products and softmax, which hide their latency
                if my_lo < my_hi:
                    fetch(BlockTable, K, V, pg_s, off_s, b, kv_head, my_lo * bn, seq_kv, page_size, max_pages,
                          num_pages, k_r, v_r)
                for kb in T.serial(my_lo, my_hi):
                    T.copy(k_r, k_s)
                    T.copy(v_r, v_s)
                    if kb + 1 < my_hi:
                        fetch(BlockTable, K, V, pg_s, off_s, b, kv_head, (kb + 1) * bn, seq_kv, page_size,
                              max_pages, num_pages, k_r, v_r)
                    scores(q_s, k_s, acc_s, p0, kb * bn, seq_kv, window, scale_log2, kb, full)
                    accumulate(acc_s, p, v_s, acc_o, m, m_prev, alpha, row_sum, l)
            elif aligned:
                # one page a tile: an affine box, pipelined. The last tile's box ends at the row's last key
                # (_box_key0: it starts up to bn - 1 keys earlier, rows of the same page or, before the page's
                # first row, TMA's zero fill), so no key past the length is read; keys of the tile before are
                # masked out of the logits
                for kb in T.Pipelined(my_lo, my_hi, num_stages=t.stages):
                    T.copy(_box(K, BlockTable, b, kv_head, kb * bn, seq_kv, bn, page_size, num_pages), k_s)
                    scores(q_s, k_s, acc_s, p0, _box_key0(kb * bn, seq_kv, bn), seq_kv, window, scale_log2, kb, full)
                    # the page's check once a tile (inside the loop below it would be a load and a 64-bit division
                    # an element: 8x slower, docs/perf-log.md v29)
                    page_ok[0] = T.if_then_else(_page_ok(BlockTable, b, kb * bn, page_size, num_pages), 1, 0)
                    for i, j in T.Parallel(bm, bn):  # keys of the tile before: out; a page outside the cache: NaN
                        acc_s[i, j] = T.if_then_else(
                            _box_key0(kb * bn, seq_kv, bn) + j < kb * bn, -T.infinity(accum),
                            T.if_then_else((page_ok[0] != 0) | (acc_s[i, j] == -T.infinity(accum)), acc_s[i, j], NAN))
                    T.copy(_box(V, BlockTable, b, kv_head, kb * bn, seq_kv, bn, page_size, num_pages), v_s)
                    accumulate(acc_s, p, v_s, acc_o, m, m_prev, alpha, row_sum, l)
            else:
                for kb in T.serial(my_lo, my_hi):
                    fetch(BlockTable, K, V, pg_s, off_s, b, kv_head, kb * bn, seq_kv, page_size, max_pages,
                          num_pages, k_s, v_s)
                    scores(q_s, k_s, acc_s, p0, kb * bn, seq_kv, window, scale_log2, kb, full)
                    accumulate(acc_s, p, v_s, acc_o, m, m_prev, alpha, row_sum, l)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            for r, d in T.Parallel(bm, dim_v):
                if p0 + r < n_rows:
                    OPart[b, kv_head * groups + (p0 + r) % groups, (p0 + r) // groups, split, d] = T.if_then_else(
                        bad_len, NAN, acc_o[r, d]
                    )
            for r in T.Parallel(bm):
                if p0 + r < n_rows:
                    LSEPart[b, kv_head * groups + (p0 + r) % groups, (p0 + r) // groups, split] = T.if_then_else(
                        bad_len, NAN, lse[r]
                    )

    return flashsink_fwd_kvcache


def _box_key0(key0, seq_kv, bn):
    """The first key of the box loaded for the tile from ``key0``: ``key0``, or for the tile of a row's last key
    ``seq_kv - bn`` (the box then ends at the last key; its first rows are masked)."""
    return T.min(key0, seq_kv - bn)


def _box(x, table, b, kv_head, key0, seq_kv, bn, page_size, num_pages):
    """The ``[bn, dim]`` box of cache ``x`` for the tile from ``key0`` (in one page: the page size a multiple of
    ``bn``): rows from ``_box_key0``'s key, in the page of ``key0``, whose row index is negative (TMA's zero fill)
    where the box starts before the page."""
    r0 = T.truncmod(key0, page_size) + _box_key0(key0, seq_kv, bn) - key0
    return x[_page(table, b, key0, page_size, num_pages), r0:r0 + bn, kv_head, :]


def _page_ok(table, b, key0, page_size, num_pages):
    """Whether the block-table entry of the page holding key ``key0`` (below the row's length) is in the cache."""
    e = table[b, T.truncdiv(key0, page_size)]
    return (e >= 0) & (e < num_pages)


def _page(table, b, key0, page_size, num_pages):
    """The page holding key ``key0`` (below the row's length); 0 for an entry outside the cache (not to be used)."""
    return T.if_then_else(_page_ok(table, b, key0, page_size, num_pages), table[b, T.truncdiv(key0, page_size)], 0)


def _slot_entry(table, b, slot, max_pages):
    """Block-table slot ``slot`` of batch row ``b`` (the index clamped into the table, for keys past the end)."""
    return table[b, T.min(slot, max_pages - 1)]


def _slot_ok(table, b, slot, max_pages, num_pages):
    """Whether block-table slot ``slot`` (clamped into the table) holds a page of the cache."""
    e = _slot_entry(table, b, slot, max_pages)
    return (e >= 0) & (e < num_pages)

