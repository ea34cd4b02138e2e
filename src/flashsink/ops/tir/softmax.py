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

from ..build.config import LOG2E  # noqa: F401  (re-exported for the kernels)
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
def load_sinks(sink_r, sinks, head, block_m: int, pack: int | None = None):
    """The rows' sink logits into ``sink_r`` (:func:`init_state`'s load alone): issued early, their latency
    runs beside whatever the caller waits for before :func:`init_from` uses them."""
    for i in T.Parallel(block_m):
        sink_r[i] = sinks[tile_head(head, i, pack)]


@T.macro
def init_from(m, l, sink_r, block_m: int):
    """:func:`init_state` with sinks, from logits :func:`load_sinks` loaded."""
    for i in T.Parallel(block_m):
        m[i] = sink_r[i] * LOG2E
        l[i] = 1.0


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
def new_max(acc_s, m, m_prev, alpha, row_sum, block_m: int, scale_log2=None, lazy: float = 0.0):
    """The first half of :func:`update`: the running maximum ``m`` over one more tile (the old one
    kept in ``m_prev``) and ``alpha``, the factor that rescales what was summed under the old one.

    ``lazy`` (> 0, base-2 units): ``m`` is the pivot of the exponentials rather than the maximum; it
    moves only where the new maximum exceeds it by more than ``lazy``, so the tile's probabilities are
    at most ``2**lazy`` and most tiles leave ``alpha`` at exactly 1 (FlashAttention-4's conditional
    rescaling: the caller then skips the output's rescale, :func:`rescale` with ``need``). Exact: the sums and the
    output carry the same pivot, which the LSE adds back."""
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
        if lazy > 0:
            # the old pivot while the maximum is within 2**lazy of it (also -inf -> finite moves: inf > lazy;
            # a NaN maximum keeps the old pivot, and the NaN logits still reach the sums)
            m[i] = T.if_then_else(m[i] - m_prev[i] > lazy, m[i], m_prev[i])
        # an unchanged maximum rescales by exactly 1, also when it is +inf (a +inf sink):
        # exp2(inf - inf) would turn the whole row into NaN where the reference gives o = 0
        alpha[i] = T.if_then_else(m_prev[i] == m[i], 1.0, T.exp2(m_prev[i] - m[i]))


@T.macro
def rescale(acc_o, alpha, block_m: int, dim_v: int, need=None):
    """The output accumulated so far, to the new maximum (``alpha`` of :func:`new_max`).

    ``need`` (a per-thread int32 buffer of one element, with ``new_max(lazy=..)``): set from the thread's
    rows' ``alpha != 1`` and voted on by the warp, so that a warp none of whose rows moved its pivot skips
    the multiplies on a uniform branch."""
    if need is None:
        for i, j in T.Parallel(block_m, dim_v):
            acc_o[i, j] *= alpha[i]
    else:
        need[0] = 0
        for i in T.Parallel(block_m):
            need[0] = need[0] | T.Cast("int32", alpha[i] != 1.0)
        if T.any_sync(need[0]):
            for i, j in T.Parallel(block_m, dim_v):
                acc_o[i, j] *= alpha[i]


#: adding 1.5 * 2**23 to a float32 of magnitude below 2**22 rounds it to an integer, which the sum then
#: holds in its low mantissa bits
_ROUNDER = 12582912.0
#: 2**f for f in [-0.5, 0.5], degree 4, the constant term 1 (so 2**0 is exactly 1, as the hardware's), fitted
#: to the relative error: at most 2.9e-6 evaluated in float32, against ~2e-7 for the hardware's ex2.approx
_EXP2_POLY = (1.0, 0.6931241750717163, 0.24024099111557007, 0.055906426161527634, 0.009582852013409138)


def exp2_fma(x):
    """``2**x`` for float32 ``x`` without the special-function unit: ``x = n + f`` (n an integer, |f| <=
    1/2, by the rounding sum), 2**f by a polynomial on the FMA pipe, n added to its exponent bits. As
    ``exp2`` for what the softmax gives it: 0 below -126 (and for -inf), NaN for NaN; ``x <= 127``
    (the softmax's exponents are at most ~0). FlashAttention-4's way to take part of the exponentials
    off the MUFU pipe, which at head dim 64 takes as long as the tile's products."""
    t = x + _ROUNDER
    # round(x) = t - ROUNDER, through t's bits: the simplifier would otherwise fold x - ((x + R) - R)
    # to 0 (it treats float sums as exact)
    f = x - (T.reinterpret(T.reinterpret(t, "int32"), "float32") - _ROUNDER)
    p = T.float32(_EXP2_POLY[-1])
    for c in reversed(_EXP2_POLY[:-1]):
        p = p * f + T.float32(c)
    y = T.reinterpret(T.reinterpret(p, "int32") + T.shift_left(T.reinterpret(t, "int32"), 23), "float32")
    # x >= -126: the polynomial; below: 0; NaN fails both comparisons and stays NaN
    return T.if_then_else(x >= -126.0, y, T.if_then_else(x < -126.0, T.float32(0), x))


def _exponent(s, m_i, scale_log2):
    """``x - m`` in base 2 for a logit ``s``: pre-scaled, or (``scale_log2``) scaled in the same FMA."""
    return s - m_i if scale_log2 is None else s * scale_log2 - m_i


@T.macro
def exp_sum(acc_s, m, alpha, row_sum, l, block_m: int, block_n: int, scale_log2=None, fma_every: int = 0):
    """The second half of :func:`update`: ``acc_s`` to ``exp2(x - m)`` and the normalizer ``l``.
    ``fma_every`` (> 0): the columns of every ``fma_every``-th group of 8 (those a thread holds in the same
    registers of every wgmma tile) take :func:`exp2_fma` instead of the MUFU's ``exp2``."""
    for i, j in T.Parallel(block_m, block_n):
        if fma_every:
            acc_s[i, j] = T.if_then_else((j // 8) % fma_every == 0, exp2_fma(_exponent(acc_s[i, j], m[i], scale_log2)),
                                         T.exp2(_exponent(acc_s[i, j], m[i], scale_log2)))
        else:
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
