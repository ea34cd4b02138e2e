"""Split-KV forward against a paged KV cache (``attention_kvcache``: decode and chunked prefill).

The split-KV kernel of ``fwd_split.py`` with the keys read through a block table:

- key ``j`` of batch row ``b`` is row ``j % page_size`` of page ``BlockTable[b, j // page_size]``.
  Each key tile's rows are first resolved to (page, row in the page), once per key and in 32-bit
  integers, into a shared-memory table; the K and V loads then gather their rows through it, one tile
  ahead into registers, so that their latencies overlap the tile before. One kernel serves every page
  size (a runtime value, like the lengths) and a key tile may span several pages. A contiguous cache ``[B, S_max, H_kv, D]`` is the same kernel with B pages of S_max rows and
  the block table ``[[0], [1], ...]``.
- each batch row has its own length, ``SeqLens[b]``, read on the device: one launch serves a batch
  of sequences of different lengths (``seq_q`` new tokens each, the last ``seq_q`` of the row).
- rows are packed query-major, ``p = r * groups + g``: a tile holds all heads of a GQA group for
  consecutive query rows, so each K/V tile is read once per group and a chunk's rows have a tight
  key range.
- only the key tiles that some query row of the tile does not see whole (the rows' last keys, a
  window's leading edge) take the per-element mask; the others are only scaled
  (``block_range.full_kv_blocks_for_rows``, one branch a tile: ``mask.branch_tile``).
- checks on the device, instead of on the host (no sync): a length outside ``[0, max_pages *
  page_size]`` gives NaN partials for the whole row (nothing is read); a used page index outside
  ``[0, num_pages)`` is not read: its keys are NaN, so every query row that sees such a key gets
  NaN (o and lse). Nothing is ever read out of bounds.

Partials (fp32 o and natural-log LSE without the sink, one per split) are merged by
``merge_splits.py``.

``kv_fp8=True`` (a draft, issue 53's next step: built and compiled in tests/test_kvcache_fp8.py, not routed
until it is timed on a GPU): K and V in float8_e4m3fn, gathered as above and widened to q's dtype on their way
into registers (exact), with float32 ``KScale`` / ``VScale`` ``[H_kv]``. A program has one KV head, so its
scales are two numbers: K's is folded into the logits' scale and V's into o, never multiplied per element. A
scale that is not finite and > 0 makes the program's partials NaN, as a bad length does.
"""

import tilelang.language as T

from ..tir import softmax
from ..tir.block_range import full_kv_blocks_for_rows, kv_blocks_for_rows, split_blocks
from ...kernel_config import KernelConfig, split_tiles
from ..tir.layout import QueryMajor, optional
from ..tir.mask import branch_tile, in_blocks, packed_logits
from .fwd_split import alloc_tiles

NAN = float("nan")
FP8 = "float8_e4m3fn"  # torch.float8_e4m3fn
#: the table's page of a key row past its batch row's length (loaded as zeros) and of a row whose
#: block-table entry is outside the cache (its keys NaN)
PAST_END, BAD_PAGE = -1, -2


def build_fwd_kvcache(cfg: KernelConfig, kv_fp8: bool = False):
    """The kernel: each key tile's rows resolved to pages once, in a shared table (``resolve``), its K/V
    rows gathered through it into registers one tile ahead (``fetch``), and stored to shared memory at
    the next step's start, so the gather's loads are in flight while the tile computes. ``kv_fp8``: the
    fp8 cache's draft (module docstring); the default kernel is the same TIR with or without it."""
    t = split_tiles(cfg)
    bm, bn = t.block_m, t.block_n
    dim, dim_v, groups = cfg.head_dim, cfg.head_dim_v, cfg.groups
    dtype, accum = cfg.dtype, "float32"
    kv_dtype = FP8 if kv_fp8 else dtype
    # the fp8 draft's changes, as plain functions of its scales: with kv_fp8 off each returns its argument,
    # so the default kernel's expressions are untouched

    def widen(x):
        return T.cast(x, dtype) if kv_fp8 else x

    def logit_scale(scale_log2, KScale, kv_head):
        return scale_log2 * KScale[kv_head] if kv_fp8 else scale_log2

    def out_value(x, VScale, kv_head):
        return x * VScale[kv_head] if kv_fp8 else x

    def bad_row(bad_len, KScale, VScale, kv_head):
        if not kv_fp8:
            return bad_len
        k, v = KScale[kv_head], VScale[kv_head]  # NaN fails both comparisons
        return bad_len | T.Not((k > 0) & (k < T.infinity(accum)) & (v > 0) & (v < T.infinity(accum)))

    batch, heads, seq_q, num_pages, page_size, max_pages, n_splits = T.dynamic(
        "batch, heads, seq_q, num_pages, page_size, max_pages, n_splits"
    )
    heads_kv = heads // groups
    n_rows = groups * seq_q  # packed rows per (batch row, KV head)
    m_tiles = T.ceildiv(n_rows, bm)

    @T.macro
    def scores(q_s, k_s, acc_s, p0, key0, seq_kv, window, scale_log2, kb, full):
        """The tile's logits, masked and scaled into base 2 (``mask.packed_logits``): key block ``kb`` in ``full``
        (the blocks every query row of the tile sees whole) only scaled; rows past the packed ones (q zero)
        then keep finite logits, never stored, never mixed into another row's softmax."""
        T.clear(acc_s)
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        branch_tile(packed_logits, in_blocks(kb, full), acc_s, QueryMajor(p0, n_rows, groups), key0, seq_q, seq_kv,
                    window, scale_log2, True)

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
                pg_s[r] >= 0, widen(K[pg_s[r], off_s[r], kv_head, d]),
                T.if_then_else(pg_s[r] == PAST_END, T.cast(0, dtype), T.cast(NAN, dtype)),
            )
        for r, d in T.Parallel(bn, dim_v):
            v_to[r, d] = T.if_then_else(pg_s[r] >= 0, widen(V[pg_s[r], off_s[r], kv_head, d]), T.cast(0, dtype))

    @T.macro
    def body(Q, K, V, BlockTable, SeqLens, KScale, VScale, window, scale_log2, OPart, LSEPart):
        with T.Kernel(n_splits * m_tiles, heads_kv, batch, threads=t.threads) as (bx, kv_head, b):
            q_s, k_s, v_s, acc_s, p, acc_o = alloc_tiles(bm, bn, dim, dim_v, dtype)
            m, m_prev, alpha, row_sum, l, lse = softmax.alloc_state(bm)
            pg_s = T.alloc_shared([bn], "int32")  # each key row's page (or PAST_END / BAD_PAGE)
            off_s = T.alloc_shared([bn], "int32")  # and its row in the page
            k_r = T.alloc_fragment([bn, dim], dtype)  # the next tile's key and value rows, loaded while
            v_r = T.alloc_fragment([bn, dim_v], dtype)  # this tile computes

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
            full = full_kv_blocks_for_rows(lo, hi, first_row, last_row - first_row + 1, bn, seq_q, seq_kv, window, True)
            my_lo, my_hi = split_blocks(lo, hi, (split, n_splits))

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
                scores(q_s, k_s, acc_s, p0, kb * bn, seq_kv, window, logit_scale(scale_log2, KScale, kv_head), kb,
                       full)
                accumulate(acc_s, p, v_s, acc_o, m, m_prev, alpha, row_sum, l)

            softmax.finalize(acc_o, m, l, lse, bm, dim_v)
            for r, d in T.Parallel(bm, dim_v):
                if p0 + r < n_rows:
                    OPart[b, kv_head * groups + (p0 + r) % groups, (p0 + r) // groups, split, d] = T.if_then_else(
                        bad_row(bad_len, KScale, VScale, kv_head), NAN, out_value(acc_o[r, d], VScale, kv_head)
                    )
            for r in T.Parallel(bm):
                if p0 + r < n_rows:
                    LSEPart[b, kv_head * groups + (p0 + r) % groups, (p0 + r) // groups, split] = T.if_then_else(
                        bad_row(bad_len, KScale, VScale, kv_head), NAN, lse[r]
                    )

    # one signature for both: without kv_fp8 the scales are no parameters and None in the body
    def flashsink_fwd_kvcache(
        Q: T.Tensor([batch, seq_q, heads, dim], dtype),
        K: T.Tensor([num_pages, page_size, heads_kv, dim], kv_dtype),
        V: T.Tensor([num_pages, page_size, heads_kv, dim_v], kv_dtype),
        BlockTable: T.Tensor([batch, max_pages], "int32"),
        SeqLens: T.Tensor([batch], "int32"),
        KScale: optional(kv_fp8, T.Tensor([heads_kv], accum)),  # per KV head (a per-tensor scale expanded on the host)
        VScale: optional(kv_fp8, T.Tensor([heads_kv], accum)),
        window: T.int32,
        scale_log2: T.float32,
        OPart: T.Tensor([batch, heads, seq_q, n_splits, dim_v], accum),
        LSEPart: T.Tensor([batch, heads, seq_q, n_splits], accum),
    ):
        body(Q, K, V, BlockTable, SeqLens, KScale, VScale, window, scale_log2, OPart, LSEPart)

    flashsink_fwd_kvcache.__name__ = "flashsink_fwd_kvcache_fp8" if kv_fp8 else "flashsink_fwd_kvcache"
    return T.prim_func(flashsink_fwd_kvcache)


def _slot_entry(table, b, slot, max_pages):
    """Block-table slot ``slot`` of batch row ``b`` (the index clamped into the table, for keys past the end)."""
    return table[b, T.min(slot, max_pages - 1)]


def _slot_ok(table, b, slot, max_pages, num_pages):
    """Whether block-table slot ``slot`` (clamped into the table) holds a page of the cache."""
    e = _slot_entry(table, b, slot, max_pages)
    return (e >= 0) & (e < num_pages)

