"""The main backward's arguments, defined once for its two kernels (``bwd.build_bwd``'s and
``bwd_ws.build_bwd_ws``'s, which differ only in schedule): the sizes they run over, the shapes and
dtypes of their tensors, and the entry point that binds those tensors to a kernel body."""

from types import SimpleNamespace

import tilelang.language as T

from ..tir.layout import kernel, optional, qkv_shapes, stat_shape, varlen_params
from ..tir.schedule import grid


def main_bwd_shapes(cfg, split: int) -> SimpleNamespace:
    """The dynamic sizes (``batch, heads, seq_q, seq_kv, rows_pad, rows_pad_kv``), ``heads_kv`` and
    the tensors' shapes. With ``split > 1`` dK and dV are fp32 accumulators with padded rows
    (``dkv_dtype``); deterministic configurations take no dQ accumulator (``with_dq``)."""
    if cfg.groups % split or (split > 1 and (cfg.deterministic or cfg.head_dim != cfg.head_dim_v)):
        raise ValueError(f"split={split} needs a divisor of groups={cfg.groups}, a non-deterministic "
                         "configuration and head_dim == head_dim_v")
    layout, dim, dim_v = cfg.layout, cfg.head_dim, cfg.head_dim_v
    batch, heads, seq_q, seq_kv, rows_pad, rows_pad_kv = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad, rows_pad_kv")
    heads_kv = heads // cfg.groups
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(layout, batch, heads, heads_kv, seq_q, seq_kv, dim, dim_v)
    st_shape = stat_shape(layout, batch, heads, rows_pad)
    dk_shape, dv_shape = k_shape, v_shape
    if split > 1:
        dk_shape = dv_shape = stat_shape(layout, batch, heads_kv, rows_pad_kv) + [dim]
    return SimpleNamespace(
        batch=batch, heads=heads, heads_kv=heads_kv, seq_q=seq_q, seq_kv=seq_kv,
        q_shape=q_shape, k_shape=k_shape, v_shape=v_shape, o_shape=o_shape, st_shape=st_shape,
        acc_shape=st_shape + [dim], dk_shape=dk_shape, dv_shape=dv_shape,
        dkv_dtype="float32" if split > 1 else cfg.dtype, with_dq=not cfg.deterministic,
    )


def main_bwd_entry(cfg, s: SimpleNamespace, body, block_n: int):
    """The kernel ``flashsink_bwd`` (``flashsink_bwd_varlen`` for thd) over the tensors of
    ``s`` (:func:`main_bwd_shapes`): ``body`` runs over the KV tiles of ``block_n`` rows and the
    sequences (its last two arguments, ``schedule.grid``'s)."""
    layout, dtype, accum = cfg.layout, cfg.dtype, "float32"
    q_shape, k_shape, v_shape, o_shape, st_shape = s.q_shape, s.k_shape, s.v_shape, s.o_shape, s.st_shape
    acc_shape, dk_shape, dv_shape, dkv_dtype, with_dq = s.acc_shape, s.dk_shape, s.dv_shape, s.dkv_dtype, s.with_dq
    seq_kv, batch = s.seq_kv, s.batch
    cu, longest, n_cu = varlen_params(layout)

    @kernel("flashsink_bwd", layout)
    def flashsink_bwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        dO: T.Tensor(o_shape, dtype),
        LSE: T.Tensor(st_shape, accum),
        Delta: T.Tensor(st_shape, accum),
        CuQ: cu,
        CuK: cu,
        max_seqlen_k: longest,
        window: T.int32,
        scale: T.float32,
        dQAcc: optional(with_dq, T.Tensor(acc_shape, accum)),
        dK: T.Tensor(dk_shape, dkv_dtype),
        dV: T.Tensor(dv_shape, dkv_dtype),
    ):
        body(Q, K, V, dO, LSE, Delta, CuQ, CuK, window, scale, dQAcc, dK, dV, *grid(layout, seq_kv, n_cu, batch, block_n))

    return flashsink_bwd
