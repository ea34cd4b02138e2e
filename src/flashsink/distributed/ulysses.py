"""Ulysses attention: an all-to-all from sequence sharding to head sharding, one local
:func:`flashsink.attention`, and the all-to-all back (:func:`ulysses_attention`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import attention
from .sharding import check_local_args, gather_same_shapes, group_size_rank


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


class _Reshard(torch.autograd.Function):
    """The all-to-all between the layouts, one way (``to_heads``: :func:`_seq_to_head`, else
    :func:`_head_to_seq`); its backward is the other way."""

    @staticmethod
    def forward(ctx, x, group, p, to_heads: bool):
        ctx.group, ctx.p, ctx.to_heads = group, p, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group, p)

    @staticmethod
    def backward(ctx, g):
        return (_head_to_seq if ctx.to_heads else _seq_to_head)(g, ctx.group, ctx.p), None, None, None


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
    spec = check_local_args("ulysses_attention", q, k, v, sinks, window=window, causal=causal, scale=scale,
                            layout=layout, deterministic=deterministic)
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    h, hk = spec.heads, spec.kv_heads
    p, rank = group_size_rank("ulysses_attention", group)
    mode = _kv_mode(h, hk, p)
    gather_same_shapes(spec, group, p, q.device)
    hl = h // p

    if p == 1:
        qh, kh, vh = q, k, v
    else:
        if mode == "replicate":
            rep = p // hk  # KV head j serves ranks [j*rep, (j+1)*rep)
            k = _Replicate.apply(k, rep)
            v = _Replicate.apply(v, rep)
        qh = _Reshard.apply(q, group, p, True)
        kh = _Reshard.apply(k, group, p, True)
        vh = _Reshard.apply(v, group, p, True)

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
        o = _Reshard.apply(oh, group, p, False)
        lse_seq = _head_to_seq(lse, group, p).squeeze(-1) if sinks is not None else None

    if sinks is not None:
        o = _SinkGrad.apply(o, sinks, lse_seq)
    if layout == "bhsd":
        o = o.transpose(1, 2)
    return o
