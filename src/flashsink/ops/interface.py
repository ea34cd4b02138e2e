"""``flashsink.attention`` on CUDA tensors: input preparation, launches, autograd.

The autograd function is thin: it saves tensors and calls ``_forward`` / ``_backward``.
Validation happened once, in the public function (``flashsink.api``).
"""

import torch

from .compile import get_kernel
from .config import MAX_HEAD_DIM, NO_WINDOW, SUPPORTED_DTYPES, KernelConfig, arch_of

# Row statistics (lse, Delta) and the fp32 dQ accumulator are allocated with this many
# rows per multiple: every kernel's row tile is then in bounds, and the row stride of
# an fp32 [.., rows] tensor stays 16-byte aligned as the bulk-copy engine requires.
ROW_PAD = 128


def _padded_rows(seq_q: int) -> int:
    return max(ROW_PAD, (seq_q + ROW_PAD - 1) // ROW_PAD * ROW_PAD)


def kernel_config(spec, device, deterministic: bool) -> KernelConfig:
    """The static configuration for a validated problem, or NotImplementedError."""
    if spec.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"flashsink kernels support float16 and bfloat16 inputs on CUDA; got {spec.dtype}. "
            "Cast q, k, v to one of those, or use flashsink.reference.attention for other dtypes."
        )
    for name, d in (("head_dim of q and k", spec.head_dim), ("head_dim of v", spec.head_dim_v)):
        if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
            raise NotImplementedError(
                f"flashsink kernels support head dims that are multiples of 16 up to {MAX_HEAD_DIM} "
                f"(64 and 128 are the fast ones); the {name} is {d}."
            )
    return KernelConfig(
        arch=arch_of(device),
        dtype=SUPPORTED_DTYPES[spec.dtype],
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v,
        groups=spec.heads // spec.kv_heads,
        causal=spec.causal,
        has_sinks=spec.has_sinks,
        layout=spec.layout,
        deterministic=bool(deterministic),
    )


def _forward(q, k, v, sinks32, cfg, spec, window):
    B, H, Sq = spec.batch, spec.heads, spec.seq_q
    o_shape = (B, H, Sq, spec.head_dim_v) if cfg.layout == "bhsd" else (B, Sq, H, spec.head_dim_v)
    o = torch.empty(o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, _padded_rows(Sq)), dtype=torch.float32, device=q.device)
    get_kernel("fwd", cfg)(q, k, v, sinks32, window, float(spec.scale) * 1.4426950408889634, o, lse)
    return o, lse


def _backward(do, q, k, v, o, lse, dlse, sinks32, cfg, spec, window):
    from .config import bwd_tiles

    B, H, Sq = spec.batch, spec.heads, spec.seq_q
    dev = q.device
    rows = lse.shape[-1]
    delta = torch.empty((B, H, rows), dtype=torch.float32, device=dev)
    dlse_padded = torch.zeros((B, H, rows), dtype=torch.float32, device=dev)
    if dlse is not None:
        dlse_padded[:, :, :Sq] = dlse
    get_kernel("preprocess", cfg)(o, do, dlse_padded, delta)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    scale = float(spec.scale)
    if cfg.deterministic:
        # dK/dV (and per-program sink partials) here, dQ in a second, atomic-free pass:
        # bitwise reproducible.
        n_kv = -(-spec.seq_kv // bwd_tiles(cfg).block_n)
        dsink_part = torch.zeros((B, H, max(n_kv, 1)), dtype=torch.float32, device=dev)
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, sinks32, window, scale, dk, dv, dsink_part)
        get_kernel("dq", cfg)(q, k, v, do, lse, delta, window, scale, dq)
        dsink = dsink_part.sum(dim=(0, 2))
    else:
        dq_acc = torch.zeros((B, H, rows, spec.head_dim), dtype=torch.float32, device=dev)
        dsink = torch.zeros((H,), dtype=torch.float32, device=dev)
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, sinks32, window, scale, dq_acc, dk, dv, dsink)
        get_kernel("postprocess", cfg)(dq_acc, dq)
    if not cfg.has_sinks:
        return dq, dk, dv, None
    if dlse is not None:
        # d lse / d sink = exp(sink - lse): the part of dsink that flows through lse.
        dsink = dsink + (torch.exp(sinks32[None, :, None] - lse[:, :, :Sq]) * dlse).sum(dim=(0, 2))
    return dq, dk, dv, dsink


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg, spec, window):
        sinks32 = _sinks_f32(sinks, spec.heads, q.device)
        o, lse = _forward(q, k, v, sinks32, cfg, spec, window)
        ctx.save_for_backward(q, k, v, o, lse, sinks32)
        ctx.cfg, ctx.spec, ctx.window = cfg, spec, window
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return o, lse[:, :, : spec.seq_q]

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks32 = ctx.saved_tensors
        spec = ctx.spec
        do = do.contiguous()
        dq, dk, dv, dsink = _backward(do, q, k, v, o, lse, dlse, sinks32, ctx.cfg, spec, ctx.window)
        if dsink is not None:
            dsink = dsink.to(ctx.sinks_dtype)
        return dq, dk, dv, dsink, None, None, None


def _sinks_f32(sinks, heads, device):
    if sinks is None:
        return torch.zeros((heads,), dtype=torch.float32, device=device)  # not read by the kernels
    return sinks.detach().to(torch.float32).contiguous()


def kernel_attention(spec, q, k, v, sinks, *, return_lse=False, deterministic=False):
    """Run validated inputs through the kernels (autograd for q, k, v and sinks)."""
    cfg = kernel_config(spec, q.device, deterministic)
    window = NO_WINDOW if spec.window is None else min(int(spec.window), NO_WINDOW)
    if spec.batch == 0 or spec.heads == 0 or spec.seq_q == 0:
        return _empty_result(spec, q, k, v, sinks, return_lse)
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    o, lse = _SinkAttention.apply(q, k, v, sinks, cfg, spec, window)
    return (o, lse) if return_lse else o


def _empty_result(spec, q, k, v, sinks, return_lse):
    """No query rows: empty outputs, still attached to the graph so backward works."""
    shape = list(q.shape)
    shape[-1] = spec.head_dim_v
    o = q.new_zeros(shape) + 0 * (q.sum() + k.sum() + v.sum() + (0 if sinks is None else sinks.sum()))
    lse = torch.full((spec.batch, spec.heads, spec.seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    return (o, lse) if return_lse else o
