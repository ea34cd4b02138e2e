"""The forward's arguments, defined once for its two kernels (``fwd.build_fwd_pipelined``'s and
``fwd_ws.build_fwd_ws``'s, which differ only in schedule): the sizes they run over, the shapes and
dtypes of their tensors, and the entry point that binds those tensors to a kernel body."""

from types import SimpleNamespace

import tilelang.language as T

from ...kernel_config import KernelConfig
from ..tir.layout import kernel, optional, qkv_shapes, stat_shape, varlen_params
from ..tir.schedule import grid


def fwd_shapes(cfg: KernelConfig) -> SimpleNamespace:
    """The forward's dynamic sizes (``batch, heads, seq_q, seq_kv``) and its tensors' shapes, defined
    once for ``fwd.build_fwd_pipelined``'s and ``fwd_ws.build_fwd_ws``'s kernels."""
    batch, heads, seq_q, seq_kv, rows_pad = T.dynamic("batch, heads, seq_q, seq_kv, rows_pad")
    q_shape, k_shape, v_shape, o_shape = qkv_shapes(cfg.layout, batch, heads, heads // cfg.groups, seq_q, seq_kv,
                                                    cfg.head_dim, cfg.head_dim_v)
    return SimpleNamespace(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, q_shape=q_shape, k_shape=k_shape,
                           v_shape=v_shape, o_shape=o_shape, lse_shape=stat_shape(cfg.layout, batch, heads, rows_pad))


def fwd_entry(cfg: KernelConfig, s: SimpleNamespace, body, block_m: int, o32: bool = False):
    """The kernel ``flashsink_fwd`` (``flashsink_fwd_varlen`` for thd) over the tensors of ``s``
    (:func:`fwd_shapes`): ``body`` runs over the row tiles of ``block_m`` rows and the sequences (the
    two arguments after ``LSE``, ``schedule.grid``'s). ``o32`` (``fwd_ws.build_fwd_ws``'s option): one
    more output, ``O32``, the output in fp32 (o's shape), passed to ``body`` last (None without it)."""
    layout, dtype, accum = cfg.layout, cfg.dtype, "float32"
    q_shape, k_shape, v_shape, o_shape, lse_shape = s.q_shape, s.k_shape, s.v_shape, s.o_shape, s.lse_shape
    heads, seq_q, batch = s.heads, s.seq_q, s.batch
    cu, longest, n_cu = varlen_params(layout)

    @kernel("flashsink_fwd", layout)
    def flashsink_fwd(
        Q: T.Tensor(q_shape, dtype),
        K: T.Tensor(k_shape, dtype),
        V: T.Tensor(v_shape, dtype),
        Sinks: T.Tensor([heads], accum),
        CuQ: cu,
        CuK: cu,
        max_seqlen_q: longest,
        window: T.int32,
        scale_log2: T.float32,
        O: T.Tensor(o_shape, dtype),
        LSE: T.Tensor(lse_shape, accum),
        O32: optional(o32, T.Tensor(o_shape, accum)),
    ):
        body(Q, K, V, Sinks, CuQ, CuK, window, scale_log2, O, LSE, *grid(layout, seq_q, n_cu, batch, block_m), O32)

    return flashsink_fwd
