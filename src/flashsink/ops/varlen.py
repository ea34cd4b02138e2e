"""``flashsink.attention_varlen`` on CUDA tensors: packed ``[total_tokens, heads, dim]``
batches (layout ``thd``) through the same kernels as the padded layouts.

Sequence ``b`` is rows ``cu_seqlens[b] : cu_seqlens[b + 1]``. The kernels' grids are sized by
``max_seqlen_q`` / ``max_seqlen_k`` and read the offsets on the device, so new lengths (and a
new number of sequences) never recompile. Row statistics are ``[heads, rows]`` over the
packed rows, padded one row tile past the last token. The launches are ``interface``'s, with
``cu_seqlens``.
"""

from dataclasses import replace

import torch

from . import interface
from .config import NO_WINDOW
from .interface import _pad_dim, _sinks_f32, kernel_config


def _rows(total: int) -> int:
    """Rows of a packed batch's statistics (``interface._stat_shape`` for ``thd``): whole row
    tiles of the last sequence may start at any packed row, so one tile past the end."""
    return interface._padded_rows(total + interface.ROW_PAD)


def _forward(q, k, v, sinks32, cu_q, cu_k, cfg, spec, window):
    """The forward launch (``interface._forward``) on a packed batch: lse ``[heads, rows]``."""
    return interface._forward(q, k, v, sinks32, cfg, spec, window, cu_seqlens=(cu_q, cu_k))


def _backward(do, q, k, v, lse, dlse, sinks32, cu_q, cu_k, cfg, spec, window):
    """The backward launches (``interface._backward``) on a packed batch."""
    return interface._backward(do, q, k, v, lse, dlse, sinks32, cfg, spec, window, cu_seqlens=(cu_q, cu_k))


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
    if spec.layout != "thd":  # validate_varlen's spec already is (dataclasses.replace costs ~5 us)
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
    padded = spec
    if (cfg.head_dim, cfg.head_dim_v) != (spec.head_dim, spec.head_dim_v):
        padded = replace(spec, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v)
    o, lse = _SinkAttentionVarlen.apply(q, k, v, sinks, cu_q, cu_k, cfg, padded, window)
    if cfg.head_dim_v != spec.head_dim_v:
        o = o[..., : spec.head_dim_v]
    return (o, lse) if return_lse else o
