"""Ring attention: K/V blocks passed around a ring of point-to-point sends, each block split into
pieces that are one :func:`flashsink.attention` call each (:func:`ring_attention`). Shards:
:mod:`.sharding`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import attention
from ..combine import merge_partials  # the partials are ours: no per-step check (no host sync)
from ..visibility import first_key, first_query, query_end
from .sharding import check_local_args, gather_same_shapes, group_size_rank, segments


# -- the mask of one (query segment, key segment) pair, as flashsink.attention calls ------------
#
# Queries at global positions [x, y), keys at [a, b); visible: j <= i and (window W) j >= i-W+1.
# flashsink.attention(causal=True) aligns bottom-right: it is exact for any queries [x0, y0) and
# keys [a0, y0) that END at the same position. Every pair therefore splits into at most three
# pieces, each one call:
#   "causal": queries i < b (the diagonal is inside or after the keys): keys end at the last query;
#   "full":   queries i >= b that see every key of the segment: no mask (causal=False);
#   "suffix": (window) queries i >= b that see only keys [i-W+1, b): reversing the order of both
#             queries and keys turns "j >= i-W+1" into a bottom-right causal mask, exactly.
# Queries that see no key of the segment (all of them past the window, or all before the keys)
# are in no piece; a pair with no piece is skipped.

_FULL, _CAUSAL, _SUFFIX = "full", "causal", "suffix"


def _plan_pair(x: int, y: int, a: int, b: int, causal: bool, window: int | None):
    """Pieces ``(q0, q1, k0, k1, kind)`` in global positions that cover exactly the visible
    (query, key) pairs of queries [x, y) and keys [a, b), each pair once."""
    if x >= y or a >= b:
        return []
    if not causal:
        return [(x, y, a, b, _FULL)]
    w = window
    pieces = []
    q0, q1 = max(x, first_query(a)), min(y, first_query(b))  # queries before a see nothing here
    if q0 < q1:
        k0 = a if w is None else max(a, first_key(q0, w))  # earlier keys are outside every row's window
        pieces.append((q0, q1, k0, q1, _CAUSAL))
    q0 = max(x, first_query(b))
    if q0 < y:
        if w is None:
            pieces.append((q0, y, a, b, _FULL))
        else:
            q1 = min(y, query_end(a, w))  # i - w + 1 <= a: the window covers every key
            if q0 < q1:
                pieces.append((q0, q1, a, b, _FULL))
            s0, s1 = max(q0, query_end(a, w)), min(y, query_end(b - 1, w))  # a < i - w + 1 < b: keys [i-w+1, b)
            if s0 < s1:
                pieces.append((s0, s1, first_key(s0, w), b, _SUFFIX))
    return pieces


def _plan_step(q_segs, k_segs, causal: bool, window: int | None):
    """Pieces ``(q0, q1, k0, k1, kind)`` in LOCAL indices (rows of this rank's q, rows of the held
    K/V block) for this rank's queries against one K/V block."""
    out = []
    for gq, lq, n in q_segs:
        for gk, lk, m in k_segs:
            for x0, x1, a0, a1, kind in _plan_pair(gq, gq + n, gk, gk + m, causal, window):
                out.append((lq + x0 - gq, lq + x1 - gq, lk + a0 - gk, lk + a1 - gk, kind))
    return _coalesce(out)


def _coalesce(pieces):
    """Fewer, larger calls (and fewer roundings of partial gradients).

    * Unmasked pieces that form one rectangle (same keys and adjacent rows, or same rows and
      adjacent keys) become one.
    * The two diagonal pieces of a rank's own block, with the unmasked piece between them (zig-zag:
      chunk r's keys fully visible to the later chunk 2P-1-r's rows), become one causal call on
      the whole block: local order follows global order, and local distances are at most the
      global ones, so a window that covers the unmasked piece globally covers it locally too,
      while inside each chunk local and global distances are equal.

    With zig-zag shards and a causal mask (no window) every step is then ONE call: the own block
    (causal), all rows against an earlier rank's first chunk, or the later rows against both
    chunks of a later rank.
    """
    pieces = list(pieces)
    diag = [p for p in pieces if p[4] == _CAUSAL and p[0:2] == p[2:4]]  # square, same local rows/keys
    for d1 in diag:
        for d2 in diag:
            f = (d2[0], d2[1], d1[0], d1[1], _FULL)
            if d1[1] == d2[0] and f in pieces and d1 in pieces and d2 in pieces:
                pieces = [x for x in pieces if x not in (d1, d2, f)] + [(d1[0], d2[1], d1[0], d2[1], _CAUSAL)]
    merged = True
    while merged:
        merged = False
        for i in range(len(pieces)):
            for j in range(len(pieces)):
                a, b = pieces[i], pieces[j]
                if i == j or a[4] != _FULL or b[4] != _FULL:
                    continue
                if a[2:4] == b[2:4] and a[1] == b[0]:  # same keys, b's rows follow a's
                    new = (a[0], b[1], a[2], a[3], _FULL)
                elif a[0:2] == b[0:2] and a[3] == b[2]:  # same rows, b's keys follow a's
                    new = (a[0], a[1], a[2], b[3], _FULL)
                else:
                    continue
                pieces = [x for n, x in enumerate(pieces) if n not in (i, j)] + [new]
                merged = True
                break
            if merged:
                break
    return pieces


@dataclass(frozen=True)
class _RingCfg:
    group: object
    rank: int
    p: int
    local_len: int
    zigzag: bool
    causal: bool
    window: int | None
    scale: float
    deterministic: bool

    def plan(self, src: int):
        """This rank's pieces against the K/V block of rank ``src``."""
        return _plan_step(
            segments(self.rank, self.p, self.local_len, self.zigzag),
            segments(src, self.p, self.local_len, self.zigzag),
            self.causal, self.window,
        )


def _piece(q, k, v, kind: str, cfg: _RingCfg):
    """One partial without the sink: o ``[B, n, H, D_v]`` ("bshd") and lse ``[B, H, n]``."""
    kw = dict(scale=cfg.scale, layout="bshd", return_lse=True, deterministic=cfg.deterministic)
    if kind == _FULL:
        return attention(q, k, v, None, causal=False, **kw)
    if kind == _CAUSAL:
        return attention(q, k, v, None, causal=True, window=cfg.window, **kw)
    # _SUFFIX: with rows and keys reversed, "key j >= i - W + 1" is the bottom-right causal mask.
    o, lse = attention(q.flip(1), k.flip(1), v.flip(1), None, causal=True, **kw)
    return o.flip(1), lse.flip(2)


# -- point-to-point ring ------------------------------------------------------------------------


class _Ring:
    """Send to the next rank of the group, receive from the previous one (async)."""

    def __init__(self, group, rank: int, p: int):
        g = group if group is not None else dist.group.WORLD
        self.group = group
        self.next = dist.get_global_rank(g, (rank + 1) % p)
        self.prev = dist.get_global_rank(g, (rank - 1) % p)

    def start(self, tensors, tag0: int = 0):
        """Post sends of ``tensors`` (contiguous) and receives of same-shaped buffers; returns
        (buffers, works). Distinct tags per stream keep gloo's matching unambiguous (NCCL ignores
        them); all ranks post in the same order."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag0 + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag0 + i) for i, r in enumerate(bufs)]
        return bufs, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ring_forward(q, k, v, sinks, cfg: _RingCfg):
    """o (accumulation dtype, "bshd") and the sink-inclusive lse ``[B, H, n]`` of this rank's rows."""
    b, n, h, _ = q.shape
    cdt = _acc_dtype(q.dtype)
    o_acc = torch.zeros((b, n, h, v.shape[-1]), dtype=cdt, device=q.device)
    lse_acc = torch.full((b, h, n), float("-inf"), dtype=cdt, device=q.device)
    ring = _Ring(cfg.group, cfg.rank, cfg.p) if cfg.p > 1 else None
    kv = (k.contiguous(), v.contiguous())
    for t in range(cfg.p):
        works = None
        if t < cfg.p - 1:  # the next block travels while this one is computed
            nxt, works = ring.start(kv)
        for q0, q1, k0, k1, kind in cfg.plan((cfg.rank - t) % cfg.p):
            o_p, lse_p = _piece(q[:, q0:q1], kv[0][:, k0:k1], kv[1][:, k0:k1], kind, cfg)
            # Online merge of partials over disjoint keys (no sink yet).
            o_m, lse_m = merge_partials(
                [o_acc[:, q0:q1], o_p.to(cdt)], [lse_acc[:, :, q0:q1], lse_p.to(cdt)],
                None, layout="bshd", return_lse=True,
            )
            o_acc[:, q0:q1] = o_m
            lse_acc[:, :, q0:q1] = lse_m
        if works is not None:
            _Ring.wait(works)
            kv = tuple(nxt)
    # The sink, exactly once.
    return merge_partials([o_acc], [lse_acc], sinks, layout="bshd", return_lse=True)  # sinks checked on entry


def _piece_grads(q, k, v, do, delta, lse, kind: str, cfg: _RingCfg):
    """Gradients (q, k, v) of the global loss through one piece.

    The global output is O = sum_p exp(lse_p - L) o_p with the sink-inclusive L, so the piece gets
    dL/do_p = w dO and dL/dlse_p = w (dO . o_p - Delta), w = exp(lse_p - L), Delta = dO . O; the
    piece is recomputed and differentiated by flashsink.attention's own backward (the kernels on
    CUDA). do ``[B, n, H, D_v]`` and delta, lse ``[B, H, n]`` are in the accumulation dtype.
    """
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o_p, lse_p = _piece(*leaves, kind, cfg)
        lp = lse_p.detach().to(lse.dtype)
        seen = torch.isfinite(lp)  # rows of the piece that see no key (lse_p = -inf) get nothing
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        w = torch.where(seen, torch.exp(torch.where(seen, lp, lse) - lse), zero)  # exp(lse_p - L)
        g_o = (w.transpose(1, 2).unsqueeze(-1) * do).to(o_p.dtype)
        rowdot = (do * o_p.detach().to(do.dtype)).sum(-1).transpose(1, 2)  # [B, H, n]
        g_lse = (w * (rowdot - delta)).to(lse_p.dtype)
        return torch.autograd.grad((o_p, lse_p), leaves, (g_o, g_lse))


def _ring_backward(do, q, k, v, o, lse, cfg: _RingCfg):
    """dq, dk, dv (accumulation dtype) for this rank's q and its own K/V block: K/V travel the ring
    again, and each block's dK/dV accumulator travels with it and comes home after P hops."""
    acc = o.dtype
    do = do.to(acc)
    delta = (do * o).sum(-1).transpose(1, 2)  # [B, H, n], Delta = dO . O (global O)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    ring = _Ring(cfg.group, cfg.rank, cfg.p) if cfg.p > 1 else None
    kv = (k.contiguous(), v.contiguous())
    dkv, dkv_works = None, None
    for t in range(cfg.p):
        kv_works = None
        if t < cfg.p - 1:
            nxt, kv_works = ring.start(kv)
        plan = cfg.plan((cfg.rank - t) % cfg.p)
        dk_t = dv_t = None
        if plan:
            dk_t = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_t = torch.zeros(v.shape, dtype=acc, device=v.device)
        for q0, q1, k0, k1, kind in plan:
            gq, gk, gv = _piece_grads(
                q[:, q0:q1], kv[0][:, k0:k1], kv[1][:, k0:k1], do[:, q0:q1], delta[:, :, q0:q1],
                lse[:, :, q0:q1], kind, cfg,
            )
            dq[:, q0:q1] += gq.to(acc)
            dk_t[:, k0:k1] += gk.to(acc)
            dv_t[:, k0:k1] += gv.to(acc)
        # This block's accumulator, as the ranks before this one left it.
        if t == 0:
            if dk_t is None:
                dk_t = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_t = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            _Ring.wait(dkv_works)
            if dk_t is None:
                dk_t, dv_t = dkv
            else:
                dk_t += dkv[0]
                dv_t += dkv[1]
        if ring is not None:  # pass it on; after step P-1 the next rank is the block's owner
            dkv, dkv_works = ring.start((dk_t, dv_t), tag0=2)
        else:
            dkv = (dk_t, dv_t)
        if kv_works is not None:
            _Ring.wait(kv_works)
            kv = tuple(nxt)
    if dkv_works is not None:
        _Ring.wait(dkv_works)
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg):
        o, lse = _ring_forward(q, k, v, sinks, cfg)
        ctx.save_for_backward(q, k, v, sinks, o, lse)
        ctx.cfg = cfg
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        dsinks = None
        if ctx.needs_input_grad[3]:
            # The gradient of THIS rank's loss terms (see ring_attention's docstring).
            acc = o.dtype
            delta = (do.to(acc) * o).sum(-1).transpose(1, 2)  # [B, H, n]
            p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
            dsinks = (-(p_sink * delta)).sum(dim=(0, 2)).to(sinks.dtype)
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = _ring_backward(do, q, k, v, o, lse, ctx.cfg)
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv, dsinks, None


def ring_attention(
    q,
    k,
    v,
    sinks=None,
    *,
    group=None,
    window=None,
    causal=True,
    scale=None,
    layout="bshd",
    zigzag=True,
    deterministic=False,
):
    """Sink attention over a sequence sharded across the ranks of ``group``, K/V passed in a ring.

    Args:
        q: this rank's tokens of the queries, ``[B, S/P, H, D]`` (layout "bshd", default) or
            ``[B, H, S/P, D]`` ("bhsd"). Which tokens: see ``zigzag``. Every rank passes the same
            local length.
        k, v: the same tokens of the keys and values, ``H_kv`` heads (``H % H_kv == 0``, any
            counts: heads are never split across ranks).
        sinks: ``[H]`` sink logits for all heads, the same tensor on every rank (a replicated
            parameter), or None.
        group: the process group (default: the default group); NCCL for CUDA tensors, gloo for
            CPU tensors.
        window, causal, scale, deterministic: as in :func:`flashsink.attention`, on GLOBAL
            positions. A window needs ``causal=True``.
        layout: "bshd" (default) or "bhsd".
        zigzag: True (default): rank r holds chunks r and 2P-1-r of 2P equal chunks (S divisible
            by 2P, so S/P is even), which balances the causal work; False: the contiguous chunk
            ``[r*S/P, (r+1)*S/P)``. Shard full tensors with :func:`shard_sequence` and get
            position ids with :func:`sequence_positions`.

    Returns:
        This rank's tokens of the output, same layout and order as q.

    Forward: P steps. At step t rank r holds the K/V block of rank (r - t) mod P; the next block
    is sent / received (``batch_isend_irecv``) while this one is computed. The block's keys are
    split by their global positions into pieces that each are one :func:`flashsink.attention`
    call without the sink (``return_lse=True``): fully visible (``causal=False``), diagonal
    (``causal=True`` with the window, keys ending at the last query: bottom-right alignment is
    then exact), or, with a window, the rows that see only the last keys of an earlier block
    (computed on reversed rows and keys, where that mask is bottom-right causal). Blocks whose
    keys are all masked (future blocks; blocks entirely outside the window) are skipped: no
    compute, the K/V are still passed on. Partials are merged as they come with
    :func:`flashsink.combine` (in float32, float64 for float64 inputs), and the sink is applied
    once at the end.

    Backward: K/V travel the ring again with a dK/dV accumulator per block (float32, or float64),
    which reaches its owner after P hops. Each piece is recomputed and differentiated by
    :func:`flashsink.attention`'s backward (the kernels on CUDA) with the output gradient
    ``exp(lse_p - L) * dO`` and lse gradient ``exp(lse_p - L) * (dO . o_p - Delta)``, where L is
    the final sink-inclusive LSE and ``Delta = rowsum(dO * O)`` uses the float32 O of the forward
    (saved for the backward: ``[B, S/P, H, D_v]`` float32 more memory for bf16/fp16 inputs). So
    the backward recomputes each piece's forward once. dq, dk, dv on rank r are the gradients
    of the global loss (the sum of every rank's local loss terms) w.r.t. rank r's tokens.

    Sinks: as for :func:`ulysses_attention`, ``sinks.grad`` on each rank is the gradient of that
    rank's own loss terms, ``-sum_i exp(sink - L_i) * Delta_i`` over its rows (no collective in
    the backward); summing it over the group (the usual gradient all-reduce of a replicated
    parameter) gives the global gradient, counted once.

    Precision: float32/float64 inputs give the single-process result within the precision
    standard (float64 to ~1e-12). bf16/fp16: the output does too; dq, dk, dv are float32 sums of
    per-piece gradients that flashsink.attention's backward has already rounded to the input
    dtype (one per rank for a K/V block), so they meet the standard's gate 2 but may miss gate 1's
    99% share (96-99% on the CPU tests); a backward that could hand out float32 partial
    gradients would remove that.

    Runs on every device: on CUDA the pieces are the TileLang kernels (forward and backward) and
    the merges, the flips of the reversed pieces and the Delta / sink-gradient sums are PyTorch
    ops; on CPU everything is the PyTorch reference. Every rank of the group must call it (and
    run its backward) with the same shapes and options.
    """
    spec = check_local_args("ring_attention", q, k, v, sinks, window=window, causal=causal, scale=scale,
                            layout=layout, zigzag=zigzag, deterministic=deterministic)
    n = spec.seq_q
    if zigzag and n % 2 != 0:
        raise ValueError(
            f"q: zig-zag sharding needs an even local sequence length (two chunks of S/(2P) tokens "
            f"per rank, S divisible by 2P), got {n}; pad the sequence, or pass zigzag=False"
        )
    p, rank = group_size_rank("ring_attention", group)
    # every rank must agree on the options too (else the ring would mismatch or hang)
    rows = gather_same_shapes(spec, group, p, q.device,
                              (-1 if window is None else spec.window, int(causal), int(zigzag), spec.scale))
    opts = [(None if r[0] < 0 else int(r[0]), bool(r[1]), bool(r[2]), r[3]) for r in rows]
    if any(o != opts[0] for o in opts):
        raise ValueError(
            f"window, causal, zigzag and scale must be the same on every rank; got (window, causal, "
            f"zigzag, scale) per rank = {opts}"
        )

    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    cfg = _RingCfg(
        group=group, rank=rank, p=p, local_len=n, zigzag=zigzag, causal=causal,
        window=spec.window, scale=spec.scale, deterministic=deterministic,
    )
    o = _RingAttention.apply(q, k, v, sinks, cfg)
    if layout == "bhsd":
        o = o.transpose(1, 2)
    return o
