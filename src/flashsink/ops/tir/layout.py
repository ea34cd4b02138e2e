"""Indexing for the three memory layouts, so kernels read and write tensors in place.

- ``bhsd``: ``[batch, heads, seq, dim]``;
- ``bshd``: ``[batch, seq, heads, dim]`` (Hugging Face, FlashAttention);
- ``thd``: packed variable-length batches, ``[total_tokens, heads, dim]``; sequence ``b`` is
  rows ``cu_seqlens[b] : cu_seqlens[b + 1]``.

Kernels address a sequence by ``(base, length)`` (:func:`sequence`): the row where it starts in
the tensor (0 for the padded layouts, where ``b`` selects it) and its length. Masks and block
ranges work in sequence-local rows; only addresses add ``base``.

Row statistics (LSE, Delta) and the fp32 dQ accumulator are ``[batch, heads, rows_pad]``
(padded layouts) or ``[heads, rows_pad]`` (``thd``, rows are packed tokens), with ``rows_pad``
at least one row tile past the last row, so whole-tile reads stay in bounds.
"""

import tilelang.language as T


# -- signatures: one prim_func per kernel for every layout --------------------------------------
#
# Packed (thd) kernels take three arguments more than padded ones, ``CuQ, CuK`` and the longest
# sequence (``max_seqlen``: no kernel reads it since the grid is ``schedule.grid``'s, which needs only
# shapes; kept in the launch protocol), and are named ``<name>_varlen``; the launch layer passes them positionally
# (``launch/dense.py``). A kernel is written once with every parameter; one that a configuration
# does not take is annotated :func:`optional` and is no kernel argument there.


def _absent():
    return None


def optional(present: bool, annotation):
    """``annotation`` for a prim_func parameter the kernel takes only when ``present``. Otherwise
    the parameter is not in the kernel's signature and is None in its body: TileLang calls a
    callable annotation for the parameter's value, and a None value is no kernel argument."""
    return annotation if present else _absent


def varlen_params(layout):
    """``(cu, longest, n_cu)``: the annotations of the packed kernels' ``CuQ``/``CuK`` (a factory,
    so each parameter gets its own ``[n_cu]`` int32 tensor) and of the longest sequence (unread,
    see above), optional for padded layouts, and the length of ``cu_seqlens``."""
    n_cu = T.dynamic("n_cu")
    packed = layout == "thd"
    return optional(packed, lambda: T.Tensor([n_cu], "int32")), optional(packed, T.int32), n_cu


def kernel(name: str, layout: str):
    """``T.prim_func`` named ``name``, or ``name + "_varlen"`` for packed (thd) batches."""

    def wrap(func):
        func.__name__ = f"{name}_varlen" if layout == "thd" else name
        return T.prim_func(func)

    return wrap


def row_runs(layout, batch):
    """Runs of rows a kernel over the statistics' rows loops over (the dQ postprocess): one per
    sequence, or (thd) one, the packed rows."""
    return 1 if layout == "thd" else batch


def prologue_load(cfg):
    """How a tile loaded once before a program's loop, under a condition (only when the loop
    has work), is lowered: one bulk copy waited on at once on Hopper; the default (synchronous)
    copy elsewhere (asking sm_80 for "tma" is a compile error)."""
    return "tma" if cfg.hopper else None


def qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v):
    """Shapes of q, k, v and o for ``layout`` (for ``thd``, ``seq_*`` are the total token counts)."""
    if layout == "bhsd":
        return (
            [batch, heads, seq_q, dim],
            [batch, heads_kv, seq_kv, dim],
            [batch, heads_kv, seq_kv, dim_v],
            [batch, heads, seq_q, dim_v],
        )
    if layout == "thd":
        return ([seq_q, heads, dim], [seq_kv, heads_kv, dim], [seq_kv, heads_kv, dim_v], [seq_q, heads, dim_v])
    return (
        [batch, seq_q, heads, dim],
        [batch, seq_kv, heads_kv, dim],
        [batch, seq_kv, heads_kv, dim_v],
        [batch, seq_q, heads, dim_v],
    )


def stat_shape(layout, batch, heads, rows_pad):
    """Shape of a per-row fp32 statistic (LSE, Delta)."""
    return [heads, rows_pad] if layout == "thd" else [batch, heads, rows_pad]


def sequence(layout, cu_seqlens, b, seq):
    """``(base, length)`` of sequence ``b``: ``seq`` rows from row 0 of batch ``b``, or the
    ``cu_seqlens`` slice of the packed tensor."""
    if layout == "thd":
        return cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
    return 0, seq


def tile(x, layout, b, h, s0, n, c0=None, nc=None):
    """The ``[n, dim]`` region of rows ``s0 .. s0+n`` of head ``h`` (``s0`` includes the base); columns
    ``c0 .. c0+nc`` of it if given."""
    cols = slice(None) if c0 is None else slice(c0, c0 + nc)
    if layout == "bhsd":
        return x[b, h, s0 : s0 + n, cols]
    if layout == "thd":
        return x[s0 : s0 + n, h, cols]
    return x[b, s0 : s0 + n, h, cols]


def stat_tile(x, layout, b, h, r0, n):
    """Rows ``r0 .. r0+n`` of a statistic or of the dQ accumulator, for head ``h``."""
    if layout == "thd":
        return x[h, r0 : r0 + n]
    return x[b, h, r0 : r0 + n]


def acc_tile(x, layout, b, h, r0, n, c0=None, c1=None):
    """Rows ``r0 .. r0+n`` of an fp32 ``[.., rows_pad, D]`` accumulator (dQ; dK/dV when the main
    backward splits a GQA group), for head ``h``; columns ``c0 .. c1`` where given."""
    cols = slice(None) if c0 is None else slice(c0, c1)
    if layout == "thd":
        return x[h, r0 : r0 + n, cols]
    return x[b, h, r0 : r0 + n, cols]


def stat_at(x, layout, b, h, r):
    """Row ``r`` of a statistic, for head ``h``."""
    return x[h, r] if layout == "thd" else x[b, h, r]


def index(layout, b, h, s, d):
    """The index of element ``d`` of row ``s`` of head ``h`` in a padded-layout tensor: bhsd, else
    bshd."""
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def element(layout, b, h, s, d):
    """The index of element ``d`` of row ``s`` (base included) of head ``h`` in a q/k/v/o-shaped tensor of
    any layout: :func:`index` for the padded ones, ``(s, h, d)`` for thd."""
    return (s, h, d) if layout == "thd" else index(layout, b, h, s, d)


def padded_shape(layout, batch, heads, seq, dim):
    """The shape of a padded-layout tensor, in :func:`index`'s order."""
    return list(index(layout, batch, heads, seq, dim))


# Packed rows start anywhere, and the bulk tensor copy faults on a row statistic whose first
# element is not 16-byte aligned (the row is the innermost dim there), so packed (thd) kernels
# read lse and Delta straight from global memory where they are used instead of staging a tile.


def stage_stat(x, layout, b, h, r0, n, dst):
    """Copy rows ``r0 .. r0+n`` of a statistic of a padded layout into ``dst``; nothing for thd
    (:func:`staged_stat` reads global memory there). A function, not a macro: a macro would
    rename the caller's loop-bound variables to its parameter names in the generated code."""
    if layout != "thd":
        return T.copy(stat_tile(x, layout, b, h, r0, n), dst)
    return None


def staged_stat(x, staged, layout, h, row, j):
    """Row ``row`` (= the tile's first row + ``j``, base included) of a statistic: element ``j`` of
    the tile :func:`stage_stat` staged, or (thd) global memory."""
    return x[h, row] if layout == "thd" else staged[j]


def tile_row(s0, i, pack=None):
    """The row (sequence position) of a tile's row ``i``: ``s0 + i``; or, in a tile packing a GQA
    group's heads (``pack`` positions of each, head after head), ``s0 + i % pack``."""
    return s0 + i if pack is None else s0 + i % pack


def tile_head(h, i, pack=None):
    """The head of a tile's row ``i``: ``h``; or, packed (``h`` the group's first head), ``h + i // pack``."""
    return h if pack is None else h + i // pack


class HeadMajor:
    """The rows of a split-KV tile that holds a whole GQA group (``fwd_split``): tile row ``i`` is query
    ``i % seq_q`` of the group's head ``i // seq_q``, ``n_rows`` (``groups * seq_q``) of them. A plain object
    (a macro passes it on as it is, where a TIR value would be bound to the macro's parameter name)."""

    def __init__(self, n_rows, seq_q):
        self.n_rows, self.seq_q = n_rows, seq_q

    def inside(self, i):
        return i < self.n_rows

    def query(self, i):
        return i % self.seq_q


class QueryMajor:
    """The rows of a split-KV tile from packed row ``p0`` of a GQA group's ``n_rows`` (``fwd_kvcache``): packed
    row ``p`` is query ``p // groups`` of the group's head ``p % groups`` (a tile of consecutive queries)."""

    def __init__(self, p0, n_rows, groups):
        self.p0, self.n_rows, self.groups = p0, n_rows, groups

    def inside(self, i):
        return self.p0 + i < self.n_rows

    def query(self, i):
        return (self.p0 + i) // self.groups


@T.macro
def store_rows(x, layout: str, b, h, base, s0, seq, src, rows: int, cols: int, pack=None):
    """Write the ``[rows, cols]`` tile ``src`` to rows ``base + s0 ..`` of head ``h``, dropping
    the rows at or past ``seq`` (tiles that hang over the end of a sequence); ``pack``: a packed
    GQA tile (:func:`tile_row`, :func:`tile_head`)."""
    for i, j in T.Parallel(rows, cols):
        if tile_row(s0, i, pack) < seq:
            x[element(layout, b, tile_head(h, i, pack), tile_row(base + s0, i, pack), j)] = src[i, j]


@T.macro
def store_rows_vec(x, layout: str, b, h, base, s0, seq, src, r0: int, rows: int, cols: int, lt, threads: int,
                   pack=None):
    """:func:`store_rows` for rows ``r0 .. r0+rows`` of ``src`` (shared memory) by ``threads`` threads whose
    index among them is ``lt``, 16 bytes a store: a row's ``cols`` elements are ``cols / 8`` runs of 8, and
    consecutive threads take consecutive runs, so a warp writes whole rows (full 32-byte sectors) where a
    wgmma accumulator's own layout gives each thread 4 bytes of a row (half a sector a store)."""
    runs = cols // 8
    for k in T.unroll(rows * runs // threads):
        i = r0 + (k * threads + lt) // runs
        c = (k * threads + lt) % runs * 8
        if tile_row(s0, i, pack) < seq:
            for v in T.vectorized(8):
                x[element(layout, b, tile_head(h, i, pack), tile_row(base + s0, i, pack), c + v)] = src[i, c + v]


@T.macro
def store_stat(x, layout: str, b, h, base, s0, seq, src, rows: int, pack=None):
    """Write the per-row statistic ``src`` of rows ``s0 .. s0+rows``. Padded layouts own their
    padding rows, so the whole tile is copied (packed GQA tiles, :func:`tile_row`: row by row, up to
    the padded end); packed rows past ``seq`` belong to the next sequence and are dropped."""
    if layout == "thd":
        for i in T.Parallel(rows):
            if tile_row(s0, i, pack) < seq:
                x[tile_head(h, i, pack), tile_row(base + s0, i, pack)] = src[i]
    elif pack is None:
        T.copy(src, x[b, h, s0 : s0 + rows])
    else:
        for i in T.Parallel(rows):
            if tile_row(s0, i, pack) < x.shape[2]:
                x[b, tile_head(h, i, pack), tile_row(s0, i, pack)] = src[i]


@T.macro
def clear_acc_rows(x, layout: str, b, h, base, s0, seq, rows: int, cols: int):
    """Zero rows ``base + s0 .. base + s0 + rows`` of head ``h`` of an fp32 ``[.., rows_pad, D]``
    accumulator (:func:`acc_tile`), dropping the rows at or past ``seq``: the backward's preprocess
    clears the dQ accumulator that the main backward then adds into. No result reads the rows past a
    sequence (the dQ cast drops them), so they are left as they are."""
    for i, j in T.Parallel(rows, cols):
        if s0 + i < seq:
            if layout == "thd":
                x[h, base + s0 + i, j] = T.float32(0)
            else:
                x[b, h, s0 + i, j] = T.float32(0)
