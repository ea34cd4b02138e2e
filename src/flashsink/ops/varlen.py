"""``flashsink.attention_varlen`` on CUDA tensors: packed ``[total_tokens, heads, dim]``
batches (layout ``thd``) through the same kernels as the padded layouts.

Sequence ``b`` is rows ``cu_seqlens[b] : cu_seqlens[b + 1]``. The kernels' grids are sized by
``max_seqlen_q`` / ``max_seqlen_k`` and read the offsets on the device, so new lengths (and a
new number of sequences) never recompile. Row statistics are ``[heads, rows]`` over the
packed rows, padded one row tile past the last token. The launches are ``interface``'s, with
``cu_seqlens``; ``custom_ops`` (``flashsink::varlen_fwd`` / ``varlen_bwd`` and
``kernel_attention_varlen``) wraps them with fake implementations and autograd.
"""

from . import interface


def _rows(total: int) -> int:
    """Rows of a packed batch's statistics (``interface._stat_shape`` for ``thd``): whole row
    tiles of the last sequence may start at any packed row, so one tile past the end."""
    return interface._padded_rows(total + interface.ROW_PAD)


def _forward(q, k, v, sinks32, cu_q, cu_k, cfg, spec, window):
    """The forward launch (``interface._forward``) on a packed batch: lse ``[heads, rows]``."""
    return interface._forward(q, k, v, sinks32, cfg, spec, window, cu_seqlens=(cu_q, cu_k))


def _backward(do, q, k, v, o, lse, dlse, sinks32, cu_q, cu_k, cfg, spec, window):
    """The backward launches (``interface._backward``) on a packed batch."""
    return interface._backward(do, q, k, v, o, lse, dlse, sinks32, cfg, spec, window, cu_seqlens=(cu_q, cu_k))
