"""Context parallelism on torch.distributed: Ulysses (all-to-all) and ring attention.

Import it as ``flashsink.distributed`` (``import flashsink`` does not load it).

Both split ONE sequence of length S across the P ranks of a process group; every rank passes the
same local length S/P of q, k and v (checked with one small collective per call) and gets back the
output for the tokens it holds. Window and causal positions are global (positions in the full
sequence).

* :func:`ulysses_attention` takes contiguous shards: rank r holds tokens ``[r*S/P, (r+1)*S/P)``.
  An all-to-all gives each rank all tokens for H/P heads (needs ``H % P == 0``).
* :func:`ring_attention` keeps the sequence sharding and passes K/V blocks around a ring of
  point-to-point sends (no head-count constraint). It takes contiguous shards (``zigzag=False``,
  the same as Ulysses) or, by default, zig-zag shards for causal load balance: the sequence is cut
  into 2P chunks of S/(2P) tokens and rank r holds chunks r and 2P-1-r, in that order (S divisible
  by 2P). :func:`shard_sequence`, :func:`unshard_sequence` and :func:`sequence_positions` convert
  between full tensors and either sharding.

Backends: NCCL for CUDA tensors, gloo for CPU tensors (the reference path); the code is the same.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._validate import validate_attention
from .api import attention
from .combine import combine

__all__ = [
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]


# -- all-to-all between sequence sharding and head sharding ------------------------------------


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (size P) of a contiguous buffer."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group, p: int) -> torch.Tensor:
    """[B, S/P, Hx, D] sequence-sharded -> [B, S, Hx/P, D] head-sharded (rank r: heads r*Hx/P...)."""
    b, sl, hx, d = x.shape
    buf = x.reshape(b, sl, p, hx // p, d).permute(2, 0, 1, 3, 4)  # [P(dest head group), B, S/P, h, D]
    out = _a2a(buf, group)  # [P(source seq chunk), B, S/P, h, D]
    return out.permute(1, 0, 2, 3, 4).reshape(b, p * sl, hx // p, d)


def _head_to_seq(x: torch.Tensor, group, p: int) -> torch.Tensor:
    """[B, S, Hx/P, D] head-sharded -> [B, S/P, Hx, D] sequence-sharded (inverse of _seq_to_head)."""
    b, s, h, d = x.shape
    sl = s // p
    buf = x.reshape(b, p, sl, h, d).permute(1, 0, 2, 3, 4)  # [P(dest seq chunk), B, S/P, h, D]
    out = _a2a(buf, group)  # [P(source head group), B, S/P, h, D]
    return out.permute(1, 2, 0, 3, 4).reshape(b, sl, p * h, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, p):
        ctx.group, ctx.p = group, p
        return _seq_to_head(x, group, p)

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g, ctx.group, ctx.p), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, p):
        ctx.group, ctx.p = group, p
        return _head_to_seq(x, group, p)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g, ctx.group, ctx.p), None, None


class _Replicate(torch.autograd.Function):
    """``repeat_interleave(rep, dim=2)`` whose backward sums the replicas' gradients in float32
    (float64 for float64) before rounding once to the input dtype."""

    @staticmethod
    def forward(ctx, x, rep):
        ctx.rep = rep
        return x.repeat_interleave(rep, dim=2)

    @staticmethod
    def backward(ctx, g):
        b, s, hr, d = g.shape
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        return g.to(acc).view(b, s, hr // ctx.rep, ctx.rep, d).sum(dim=3).to(g.dtype), None


# -- the sink gradient of this rank's loss terms ----------------------------------------------


class _SinkGrad(torch.autograd.Function):
    """Identity on ``o``; its backward adds the gradient of the local loss w.r.t. ``sinks``.

    With p_sink = exp(sink_h - lse) per row, d o_i / d sink_h = -p_sink_i * o_i, hence
    dL/dsink_h = -sum_i p_sink_i * (dO_i . O_i), summed over this rank's rows i only.
    """

    @staticmethod
    def forward(ctx, o, sinks, lse):
        # o [B, S/P, H, Dv], lse [B, S/P, H] (sequence-sharded, detached)
        ctx.save_for_backward(o, sinks, lse)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, sinks, lse = ctx.saved_tensors
        dsinks = None
        if ctx.needs_input_grad[1]:
            cdt = torch.float64 if torch.float64 in (o.dtype, sinks.dtype, lse.dtype) else torch.float32
            rowdot = (do.to(cdt) * o.to(cdt)).sum(dim=-1)  # [B, S/P, H]
            p_sink = torch.exp(sinks.to(cdt) - lse.to(cdt))  # [B, S/P, H]
            dsinks = (-(p_sink * rowdot)).sum(dim=(0, 1)).to(sinks.dtype)
        return do, dsinks, None


# -- public entry point ------------------------------------------------------------------------


def _kv_mode(h: int, hk: int, p: int) -> str:
    if h % p != 0:
        raise ValueError(
            f"q: the number of query heads ({h}) must be divisible by the group size ({p}) for "
            f"Ulysses attention (each rank attends with H/P = {h}/{p} heads)"
        )
    if hk % p == 0:
        return "split"
    if p % hk == 0:
        return "replicate"
    raise ValueError(
        f"k: {hk} KV heads cannot be distributed over {p} ranks: Ulysses attention needs "
        f"H_kv % P == 0 (KV heads split) or P % H_kv == 0 (KV heads replicated); got H_kv={hk}, P={p}"
    )


def ulysses_attention(
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
    deterministic=False,
):
    """Sink attention over a sequence sharded across the ranks of ``group`` (Ulysses).

    Args:
        q: this rank's chunk of the queries, ``[B, S/P, H, D]`` (layout "bshd", default) or
            ``[B, H, S/P, D]`` (layout "bhsd"). Rank r of ``group`` (size P) holds tokens
            ``[r*S/P, (r+1)*S/P)``; all ranks pass the same local length, so S is divisible by P.
        k, v: the same tokens of the keys and values, ``H_kv`` heads, ``H % H_kv == 0``; same local
            sequence length as q.
        sinks: ``[H]`` sink logits for ALL query heads, the same tensor on every rank (a
            replicated parameter), or None.
        group: the process group (default: the default group). Backends: anything with
            ``all_to_all_single`` (NCCL for CUDA tensors, gloo for CPU tensors).
        window, causal, scale, deterministic: as in :func:`flashsink.attention`, applied to the
            FULL sequence (positions are global).
        layout: "bshd" (default) or "bhsd".

    Returns:
        This rank's chunk of the output, same layout as q.

    Steps: an all-to-all gives each rank the full sequence for query heads ``[r*H/P, (r+1)*H/P)``
    (needs ``H % P == 0``) and the KV heads they use; :func:`flashsink.attention` runs locally with
    ``sinks[r*H/P:(r+1)*H/P]``; an all-to-all returns the output to sequence sharding.
    KV heads: if ``H_kv % P == 0`` they are split (rank r gets ``[r*H_kv/P, (r+1)*H_kv/P)``, which
    are exactly the KV heads of its query heads, since query head h uses KV head ``h // (H/H_kv)``);
    if ``P % H_kv == 0`` each rank gets the one KV head its query heads use (each KV head is
    replicated on ``P/H_kv`` ranks, and the backward sums the dK/dV of the replicas); any other
    head counts raise ValueError.

    Gradients: the all-to-alls are autograd Functions whose backward is the inverse all-to-all,
    so dq, dk, dv on rank r are the gradients of the global loss (the sum of every rank's local
    loss terms) w.r.t. rank r's chunk; concatenated over ranks they equal the single-process
    gradients. ``sinks`` is replicated, so its gradient follows the data-parallel convention:
    on each rank, ``sinks.grad`` (full ``[H]``, all heads) is the gradient of the loss terms THAT
    rank computed (those on its output chunk), i.e. what one process computing the same local
    loss terms on the full sequence would get. No collective runs for it in the backward; summing
    ``sinks.grad`` over the group (what a data/context-parallel gradient all-reduce does) gives the
    gradient of the global loss, counted once. (All-reducing the per-rank head slices inside the
    backward instead would put the global gradient on every rank and a later sum over the group
    would count it P times.) The sink gradient is computed from this rank's output chunk and the
    LSE (one extra all-to-all of ``[B, S, H/P]`` in the forward) as
    ``-sum_i exp(sink - lse_i) * rowsum(dO_i * O_i)`` over its rows, with O as stored in the input
    dtype: exact in float64; in bf16/fp16 more accurate than PyTorch computing in that dtype but not
    at the level of the kernels' own fp32 ``rowsum(P * dP)``. With replicated KV heads, dK/dV are the
    sum (in float32) of per-rank partials that the local backward has already rounded to the input
    dtype.
    """
    validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} ({deterministic!r})")
    if layout not in ("bshd", "bhsd"):  # validate_attention already enforces this; kept explicit
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, sl, h, d = q.shape
    skl, hk = k.shape[1], k.shape[2]
    if skl != sl:
        raise ValueError(
            f"k: local sequence length ({skl}) must equal q's ({sl}); ulysses_attention shards one "
            f"sequence (self-attention) across the ranks"
        )

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group: torch.distributed is not initialized (call init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    p = dist.get_world_size(group)
    mode = _kv_mode(h, hk, p)

    # Every rank must hold the same local shapes (else the all-to-alls would mismatch or hang).
    # All ranks see the same gathered values, so all of them raise together.
    mine = torch.tensor([b, sl, h, hk, d, v.shape[3]], dtype=torch.int64, device=q.device)
    allv = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(allv, mine, group=group)
    shapes = [tuple(t.tolist()) for t in allv]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "q: every rank must pass the same local shapes (equal sequence chunks, S divisible by the "
            f"group size); got (B, S_local, H, H_kv, D, D_v) per rank = {shapes}"
        )

    rank = dist.get_rank(group)
    hl = h // p

    if p == 1:
        qh, kh, vh = q, k, v
    else:
        if mode == "replicate":
            rep = p // hk  # KV head j serves ranks [j*rep, (j+1)*rep)
            k = _Replicate.apply(k, rep)
            v = _Replicate.apply(v, rep)
        qh = _SeqToHead.apply(q, group, p)
        kh = _SeqToHead.apply(k, group, p)
        vh = _SeqToHead.apply(v, group, p)

    local_sinks = None
    if sinks is not None:
        # Detached: the sink gradient is added at sequence sharding by _SinkGrad (see docstring).
        local_sinks = sinks.detach()[rank * hl:(rank + 1) * hl]

    out = attention(
        qh, kh, vh, local_sinks, window=window, causal=causal, scale=scale, layout="bshd",
        return_lse=sinks is not None, deterministic=deterministic,
    )
    if sinks is not None:
        oh, lse = out  # lse [B, H/P, S]
        lse = lse.detach().transpose(1, 2).unsqueeze(-1)  # [B, S, H/P, 1]
    else:
        oh = out

    if p == 1:
        o = oh
        lse_seq = lse.squeeze(-1) if sinks is not None else None
    else:
        o = _HeadToSeq.apply(oh, group, p)
        lse_seq = _head_to_seq(lse, group, p).squeeze(-1) if sinks is not None else None

    if sinks is not None:
        o = _SinkGrad.apply(o, sinks, lse_seq)
    if layout == "bhsd":
        o = o.transpose(1, 2)
    return o


# == Ring attention ============================================================================
#
# Sharding. A rank's tokens are one or two segments of the global sequence, each described as
# (global start, local start, length). Contiguous: rank r holds [r*n, (r+1)*n) with n = S/P.
# Zig-zag: with c = S/(2P), rank r holds chunk r ([r*c, (r+1)*c)) then chunk 2P-1-r, so that under
# a causal mask every rank has the same amount of work (an early chunk and its mirror late chunk).


def _segments(rank: int, p: int, local_len: int, zigzag: bool) -> tuple[tuple[int, int, int], ...]:
    """Segments ``(global_start, local_start, length)`` of the tokens rank holds, in local order."""
    if not zigzag:
        return ((rank * local_len, 0, local_len),)
    c = local_len // 2
    return ((rank * c, 0, c), ((2 * p - 1 - rank) * c, c, c))


def _check_rank_args(rank, world_size, zigzag) -> None:
    for name, x in (("world_size", world_size), ("rank", rank)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(x).__name__} ({x!r})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    if not isinstance(zigzag, bool):
        raise TypeError(f"zigzag must be a bool, got {type(zigzag).__name__} ({zigzag!r})")


def _check_seq_len(name: str, seq_len: int, world_size: int, zigzag: bool) -> int:
    """The local length S/P; S must be divisible by P (contiguous) or 2P (zig-zag)."""
    parts = 2 * world_size if zigzag else world_size
    if seq_len % parts != 0:
        how = f"2 * world_size = {parts} (zig-zag: 2P chunks)" if zigzag else f"world_size = {parts}"
        raise ValueError(
            f"{name}: sequence length {seq_len} must be divisible by {how}; pad the sequence"
            + (" or pass zigzag=False (then it needs divisibility by world_size only)" if zigzag else "")
        )
    return seq_len // world_size


def sequence_positions(rank, world_size, seq_len, *, zigzag=True, device=None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / world_size]``) of the tokens ``rank`` holds, in local order.

    Use them for position ids / RoPE of the local tokens. ``zigzag=True``: chunks ``rank`` and
    ``2*world_size-1-rank`` of ``2*world_size`` equal chunks; ``zigzag=False``: the contiguous chunk
    ``[rank*S/P, (rank+1)*S/P)``.
    """
    _check_rank_args(rank, world_size, zigzag)
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        raise TypeError(f"seq_len must be a non-negative int, got {type(seq_len).__name__} ({seq_len!r})")
    n = _check_seq_len("seq_len", int(seq_len), world_size, zigzag)
    parts = [torch.arange(g, g + m, device=device) for g, _, m in _segments(rank, world_size, n, zigzag)]
    return torch.cat(parts)


def _check_dim(x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} ({dim!r})")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()


def shard_sequence(x, rank, world_size, *, dim=1, zigzag=True) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor ``x`` along ``dim`` (1: "bshd"; 2: "bhsd").

    ``zigzag=True`` (the default of :func:`ring_attention`): chunks ``rank`` and
    ``2*world_size-1-rank`` of ``2*world_size`` equal chunks, concatenated (a new tensor; the
    sequence length must be divisible by ``2*world_size``). ``zigzag=False``: the contiguous chunk
    ``[rank*S/P, (rank+1)*S/P)`` (a view; what :func:`ulysses_attention` takes). Differentiable.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_rank_args(rank, world_size, zigzag)
    dim = _check_dim(x, dim)
    n = _check_seq_len(f"x (dim {dim})", x.shape[dim], world_size, zigzag)
    segs = _segments(rank, world_size, n, zigzag)
    if len(segs) == 1:
        return x.narrow(dim, segs[0][0], n)
    return torch.cat([x.narrow(dim, g, m) for g, _, m in segs], dim=dim)


def unshard_sequence(chunks, *, dim=1, zigzag=True) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (``chunks[r]`` from rank r, e.g. gathered
    with ``dist.all_gather``); the inverse of :func:`shard_sequence` with the same ``zigzag``."""
    if not isinstance(chunks, (list, tuple)) or len(chunks) == 0:
        raise TypeError(f"chunks must be a non-empty list of torch.Tensor (one per rank), got {chunks!r:.80}")
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"chunks[{i}] must be a torch.Tensor, got {type(c).__name__}")
    if not isinstance(zigzag, bool):
        raise TypeError(f"zigzag must be a bool, got {type(zigzag).__name__} ({zigzag!r})")
    dim = _check_dim(chunks[0], dim)
    shape0 = chunks[0].shape
    for i, c in enumerate(chunks):
        if c.shape != shape0:
            raise ValueError(
                f"chunks[{i}] must have the shape of chunks[0] ({list(shape0)}): every rank holds the "
                f"same number of tokens; got {list(c.shape)}"
            )
    if not zigzag:
        return torch.cat(list(chunks), dim=dim)
    n = shape0[dim]
    if n % 2 != 0:
        raise ValueError(
            f"chunks: zig-zag shards hold two equal chunks, so their length along dim {dim} must be even, got {n}"
        )
    c = n // 2
    first = [x.narrow(dim, 0, c) for x in chunks]
    second = [x.narrow(dim, c, c) for x in reversed(chunks)]
    return torch.cat(first + second, dim=dim)


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
    from flashsink.visibility import first_key, first_query, query_end  # absolute: survives a move

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
            _segments(self.rank, self.p, self.local_len, self.zigzag),
            _segments(src, self.p, self.local_len, self.zigzag),
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
            o_m, lse_m = combine(
                [o_acc[:, q0:q1], o_p.to(cdt)], [lse_acc[:, :, q0:q1], lse_p.to(cdt)],
                None, layout="bshd", return_lse=True,
            )
            o_acc[:, q0:q1] = o_m
            lse_acc[:, :, q0:q1] = lse_m
        if works is not None:
            _Ring.wait(works)
            kv = tuple(nxt)
    # The sink, exactly once.
    return combine([o_acc], [lse_acc], sinks, layout="bshd", return_lse=True)


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
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    if not isinstance(zigzag, bool):
        raise TypeError(f"zigzag must be a bool, got {type(zigzag).__name__} ({zigzag!r})")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} ({deterministic!r})")
    if spec.seq_kv != spec.seq_q:
        raise ValueError(
            f"k: local sequence length ({spec.seq_kv}) must equal q's ({spec.seq_q}); ring_attention "
            f"shards one sequence (self-attention) across the ranks"
        )
    n = spec.seq_q
    if zigzag and n % 2 != 0:
        raise ValueError(
            f"q: zig-zag sharding needs an even local sequence length (two chunks of S/(2P) tokens "
            f"per rank, S divisible by 2P), got {n}; pad the sequence, or pass zigzag=False"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group: torch.distributed is not initialized (call init_process_group first)")
    not_member = ValueError(
        "group: this process is not a member of the given process group (new_group gave it "
        "GroupMember.NON_GROUP_MEMBER); call ring_attention only on the group's ranks"
    )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise not_member
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise not_member

    # Every rank must agree on shapes and options (else the ring would mismatch or hang); all
    # ranks see the same gathered values, so all of them raise together.
    mine = torch.tensor(
        [spec.batch, n, spec.heads, spec.kv_heads, spec.head_dim, spec.head_dim_v,
         -1 if window is None else spec.window, int(causal), int(zigzag), spec.scale],
        dtype=torch.float64, device=q.device,
    )
    allv = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(allv, mine, group=group)
    rows = [t.tolist() for t in allv]
    shapes = [tuple(int(x) for x in r[:6]) for r in rows]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "q: every rank must pass the same local shapes (equal sequence shards); got "
            f"(B, S_local, H, H_kv, D, D_v) per rank = {shapes}"
        )
    opts = [(None if r[6] < 0 else int(r[6]), bool(r[7]), bool(r[8]), r[9]) for r in rows]
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
