"""``flashsink.attention_varlen`` on CUDA tensors: packed ``[total_tokens, heads, dim]``
batches (layout ``thd``) through the same kernels as the padded layouts.

Sequence ``b`` is rows ``cu_seqlens[b] : cu_seqlens[b + 1]``. The kernels' grids are sized by
``max_seqlen_q`` / ``max_seqlen_k`` and read the offsets on the device, so new lengths (and a
new number of sequences) never recompile. Row statistics are ``[heads, rows]`` over the
packed rows, padded one row tile past the last token.
"""

from dataclasses import replace

import torch

from .compile import get_kernel
from .config import LOG2E, NO_WINDOW, pre_tiles
from .interface import ROW_PAD, _pad_dim, _padded_rows, _sinks_f32, kernel_config


def _rows(total: int) -> int:
    # Whole row tiles of the last sequence may start at any packed row: pad one tile past it.
    return _padded_rows(total + ROW_PAD)


def _forward(q, k, v, sinks32, cu_q, cu_k, cfg, spec, window):
    total_q, heads = q.shape[0], q.shape[1]
    o = torch.empty((total_q, heads, spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, _rows(total_q)), dtype=torch.float32, device=q.device)
    get_kernel("fwd", cfg)(q, k, v, sinks32, cu_q, cu_k, spec.seq_q, window, float(spec.scale) * LOG2E, o, lse)
    return o, lse


def _backward(do, q, k, v, lse, dlse, sinks32, cu_q, cu_k, cfg, spec, window):
    total_q, heads = q.shape[0], q.shape[1]
    dev = q.device
    rows = lse.shape[-1]
    scale = float(spec.scale)
    delta = torch.empty((heads, rows), dtype=torch.float32, device=dev)
    dlse_padded = torch.zeros((heads, rows), dtype=torch.float32, device=dev)
    if dlse is not None:
        dlse_padded[:, :total_q] = dlse
    dsink = torch.zeros((heads,), dtype=torch.float32, device=dev)
    n_part = -(-spec.seq_q // pre_tiles(cfg).block_m) if cfg.deterministic else 1
    dsink_part = torch.zeros((spec.batch, heads, n_part), dtype=torch.float32, device=dev)
    get_kernel("preprocess", cfg)(
        q, k, v, do, lse, dlse_padded, sinks32, cu_q, cu_k, spec.seq_q, window, scale, delta, dsink, dsink_part
    )
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    if cfg.deterministic:
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, cu_q, cu_k, spec.seq_kv, window, scale, dk, dv)
        get_kernel("dq", cfg)(q, k, v, do, lse, delta, cu_q, cu_k, spec.seq_q, window, scale, dq)
        dsink = dsink_part.sum(dim=(0, 2))
    else:
        dq_acc = torch.zeros((heads, rows, spec.head_dim), dtype=torch.float32, device=dev)
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, cu_q, cu_k, spec.seq_kv, window, scale, dq_acc, dk, dv)
        get_kernel("postprocess", cfg)(dq_acc, dq)
    return dq, dk, dv, (dsink if cfg.has_sinks else None)


class _SinkAttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, cfg, spec, window):
        sinks32 = _sinks_f32(sinks, spec.heads, q.device)
        o, lse = _forward(q, k, v, sinks32, cu_q, cu_k, cfg, spec, window)
        ctx.save_for_backward(q, k, v, lse, sinks32, cu_q, cu_k)
        ctx.cfg, ctx.spec, ctx.window = cfg, spec, window
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return o, lse[:, : q.shape[0]]

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, lse, sinks32, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv, dsink = _backward(
            do.contiguous(), q, k, v, lse, dlse, sinks32, cu_q, cu_k, ctx.cfg, ctx.spec, ctx.window
        )
        if dsink is not None:
            dsink = dsink.to(ctx.sinks_dtype)
        return dq, dk, dv, dsink, None, None, None, None, None


def kernel_attention_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *, return_lse=False, deterministic=False):
    """Run a validated packed batch through the kernels (autograd for q, k, v and sinks)."""
    spec = replace(spec, layout="thd")
    cfg = kernel_config(spec, q.device, deterministic)
    window = NO_WINDOW if spec.window is None else min(int(spec.window), NO_WINDOW)
    if 0 in (spec.batch, q.shape[0], k.shape[0]):
        # No sequences, no query rows, or no keys anywhere: nothing to launch; the
        # reference gives the exact (differentiable) result.
        from .. import reference

        cu_q = cu_seqlens_q.detach().cpu().tolist()
        cu_k = cu_seqlens_k.detach().cpu().tolist()
        return reference._attention_varlen(q, k, v, cu_q, cu_k, sinks, spec, return_lse=return_lse)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    q, k = (_pad_dim(x, cfg.head_dim) for x in (q, k))
    v = _pad_dim(v, cfg.head_dim_v)
    padded = replace(spec, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v)
    o, lse = _SinkAttentionVarlen.apply(q, k, v, sinks, cu_q, cu_k, cfg, padded, window)
    if cfg.head_dim_v != spec.head_dim_v:
        o = o[..., : spec.head_dim_v]
    return (o, lse) if return_lse else o
