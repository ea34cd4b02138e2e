"""Online softmax whose normalizer starts from the sink.

All logits are kept in base 2 and pre-scaled: ``x = scale * log2(e) * q.k``, so each
exponential is one ``exp2``. For a row with sink logit ``sigma`` the running state
``(m, l)`` starts at ``(sigma * log2(e), 1)``: the sink is the first term of the
normalizer ``exp(sigma) + sum_j exp(s_j)``, never a fake key with a value vector.
Starting from the sink also keeps ``m`` finite, so rows whose keys are all masked
need no special case (they end with ``l = 1`` and ``o = 0``). Without a sink the
state starts at ``(-inf, 0)`` and ``m`` is replaced by 0 where it is still ``-inf``.

``lse`` (natural log, sink included) is ``(m + log2(l)) * ln(2)``.
"""


import tilelang.language as T

from ...kernel_config import LOG2E  # noqa: F401  (re-exported for the kernels)
from .layout import tile_head

LN2 = 0.6931471805599453


@T.macro
def init_state(m, l, sinks, head, block_m: int, has_sinks: bool, pack: int | None = None):
    """The running maximum and normalizer before any key: the sink's logit and 1, or -inf and 0.
    ``pack``: the rows hold heads ``head, head + 1, ..``, ``pack`` rows each (``layout.tile_head``)."""
    for i in T.Parallel(block_m):
        if has_sinks:
            m[i] = sinks[tile_head(head, i, pack)] * LOG2E
            l[i] = 1.0
        else:
            m[i] = -T.infinity("float32")
            l[i] = 0.0


@T.macro
def update(acc_s, acc_o, m, m_prev, alpha, row_sum, l, block_m: int, block_n: int, dim_v: int, scale_log2=None):
    """Fold one tile of masked, pre-scaled logits ``acc_s`` into the state.

    On return ``acc_s`` holds the unnormalized probabilities ``exp2(x - m)`` and
    ``acc_o`` has been rescaled to the new maximum; the caller adds ``acc_s @ V``.

    With ``scale_log2`` (> 0) the logits in ``acc_s`` are unscaled (masked slots -inf) and the
    scale folds into the exponent, ``exp2(s * scale_log2 - m)``, one FMA per element; the state
    stays in scaled base-2 units (so the sink start and the LSE are unchanged): the tile's
    maximum is taken unscaled, then scaled, which commutes with max for a positive scale.
    ``row_sum`` holds that maximum until the sum overwrites it.
    """
    new_max(acc_s, m, m_prev, alpha, row_sum, block_m, scale_log2)
    rescale(acc_o, alpha, block_m, dim_v)
    exp_sum(acc_s, m, alpha, row_sum, l, block_m, block_n, scale_log2)


@T.macro
def new_max(acc_s, m, m_prev, alpha, row_sum, block_m: int, scale_log2=None):
    """The first half of :func:`update`: the running maximum ``m`` over one more tile (the old one
    kept in ``m_prev``) and ``alpha``, the factor that rescales what was summed under the old one."""
    T.copy(m, m_prev)
    if scale_log2 is None:
        T.reduce_max(acc_s, m, dim=1, clear=False)
    else:
        T.reduce_max(acc_s, row_sum, dim=1)
    for i in T.Parallel(block_m):
        if scale_log2 is not None:
            m[i] = T.max(m[i], row_sum[i] * scale_log2)
        # A row with no visible key so far (no sink) keeps m = -inf: pivot on 0 instead.
        m[i] = T.if_then_else(m[i] == -T.infinity("float32"), 0.0, m[i])
        # an unchanged maximum rescales by exactly 1, also when it is +inf (a +inf sink):
        # exp2(inf - inf) would turn the whole row into NaN where the reference gives o = 0
        alpha[i] = T.if_then_else(m_prev[i] == m[i], 1.0, T.exp2(m_prev[i] - m[i]))


@T.macro
def rescale(acc_o, alpha, block_m: int, dim_v: int):
    """The output accumulated so far, to the new maximum (``alpha`` of :func:`new_max`)."""
    for i, j in T.Parallel(block_m, dim_v):
        acc_o[i, j] *= alpha[i]


def _exponent(s, m_i, scale_log2):
    """``x - m`` in base 2 for a logit ``s``: pre-scaled, or (``scale_log2``) scaled in the same FMA."""
    return s - m_i if scale_log2 is None else s * scale_log2 - m_i


@T.macro
def exp_sum(acc_s, m, alpha, row_sum, l, block_m: int, block_n: int, scale_log2=None):
    """The second half of :func:`update`: ``acc_s`` to ``exp2(x - m)`` and the normalizer ``l``."""
    for i, j in T.Parallel(block_m, block_n):
        acc_s[i, j] = T.exp2(_exponent(acc_s[i, j], m[i], scale_log2))
    T.reduce_sum(acc_s, row_sum, dim=1)
    for i in T.Parallel(block_m):
        l[i] = l[i] * alpha[i] + row_sum[i]


@T.macro
def finalize(acc_o, m, l, lse_out, block_m: int, dim_v: int):
    """Normalize ``acc_o`` in place and write the natural-log LSE into ``lse_out``.

    ``l == 0`` only for a row with no sink and no visible key: its output is 0 and its
    LSE is -inf (the reference's convention).
    """
    for i, j in T.Parallel(block_m, dim_v):
        # `l == 0`, not `l > 0`: a NaN normalizer (NaN inputs) must stay NaN, as in the reference
        acc_o[i, j] = T.if_then_else(l[i] == 0, 0.0, acc_o[i, j] / l[i])
    for i in T.Parallel(block_m):
        lse_out[i] = T.if_then_else(l[i] == 0, -T.infinity("float32"), (m[i] + T.log2(l[i])) * LN2)


def alloc_state(block_m: int) -> tuple:
    """The state's row fragments of a ``block_m``-row tile, fp32: ``(m, m_prev, alpha, row_sum, l, lse)``
    (the kernel names them by the names it unpacks them into)."""
    return tuple(T.alloc_fragment([block_m], "float32") for _ in range(6))
