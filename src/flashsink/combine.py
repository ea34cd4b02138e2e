"""Merge partial attention results computed over disjoint key ranges (context parallelism).

A partial result over a slice of the keys, without the sink, is
``flashsink.attention(q, k_slice, v_slice, None, ..., return_lse=True)`` with the mask of that slice:
``o_i = sum_{j in slice} exp(s_j - lse_i) v_j`` and ``lse_i = log sum_{j in slice} exp(s_j)``
(``lse_i = -inf`` and ``o_i = 0`` for a row that sees no key of the slice). :func:`combine` merges
them and applies each head's sink exactly once::

    lse = log(sum_i exp(lse_i) + exp(sink_h))        (the sink term only when sinks is given)
    o   = sum_i exp(lse_i - lse) * o_i

which is exactly the attention over the union of the key ranges. With ``sinks=None`` and
``return_lse=True`` the result is again a partial, so partials can be merged in any grouping
(e.g. along a ring) as long as the sink is passed in exactly one, final, call.
"""

from __future__ import annotations

import torch

from ._validate import LAYOUTS, _check_tensor, _shape

__all__ = ["combine"]


def _check_list(name: str, xs) -> list:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of torch.Tensor, got {type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{name} must hold at least one partial result, got an empty {type(xs).__name__}")
    for i, t in enumerate(xs):
        _check_tensor(f"{name}[{i}]", t)
    return list(xs)


def _validate(outs, lses, sinks, layout, return_lse):
    outs = _check_list("outs", outs)
    lses = _check_list("lses", lses)
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have one entry per partial result, got {len(outs)} outs and {len(lses)} lses"
        )
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__} ({return_lse!r})")

    what = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    o0 = outs[0]
    if o0.dim() != 4:
        raise ValueError(f"outs[0] must be 4-D {what} for layout={layout!r}, got {o0.dim()}-D shape {_shape(o0)}")
    device = o0.device
    for i, o in enumerate(outs):
        if o.shape != o0.shape:
            raise ValueError(
                f"outs[{i}] must have the shape of outs[0] {_shape(o0)} (partials over the same queries), "
                f"got {_shape(o)}"
            )
        if o.dtype != o0.dtype:
            raise ValueError(f"outs must share one dtype, got outs[0] {o0.dtype} and outs[{i}] {o.dtype}")
        if o.device != device:
            raise ValueError(f"outs must be on one device, got outs[0] on {device} and outs[{i}] on {o.device}")

    if layout == "bhsd":
        b, h, s, _ = o0.shape
    else:
        b, s, h, _ = o0.shape
    lse_shape = (b, h, s)
    l0 = lses[0]
    for i, lse in enumerate(lses):
        if tuple(lse.shape) != lse_shape:
            raise ValueError(
                f"lses[{i}] must be [B, H, S] = [{b}, {h}, {s}] to match outs ({layout} {_shape(o0)}), "
                f"got {_shape(lse)}"
            )
        if lse.dtype != l0.dtype:
            raise ValueError(f"lses must share one dtype, got lses[0] {l0.dtype} and lses[{i}] {lse.dtype}")
        if lse.device != device:
            raise ValueError(
                f"lses[{i}] must be on the device of outs ({device}), got {lse.device}"
            )
    if sinks is not None:
        _check_tensor("sinks", sinks)
        if sinks.dim() != 1 or sinks.shape[0] != h:
            raise ValueError(
                f"sinks must be 1-D of shape [{h}] (one logit per head of outs), got shape {_shape(sinks)}"
            )
        if sinks.device != device:
            raise ValueError(f"sinks must be on the device of outs ({device}), got {sinks.device}")
    return outs, lses


def combine(outs, lses, sinks=None, *, layout="bhsd", return_lse=False):
    """Merge partial attention results over disjoint key ranges, applying each head's sink once.

    Args:
        outs: list of partial outputs, each ``[B, H, S, D]`` (layout "bhsd") or ``[B, S, H, D]``
            ("bshd"), one shape, dtype and device for all.
        lses: list of the partials' natural-log LSEs (no sink in them), float ``[B, H, S]`` in both
            layouts, one per entry of ``outs``; ``-inf`` marks a row that saw no key of that range
            (its ``o`` is ignored there).
        sinks: ``[H]`` sink logits (any float dtype) applied once, or None (the result is then a
            partial again, which can itself be combined later).
        layout: "bhsd" or "bshd", the layout of ``outs`` and of the returned o.
        return_lse: also return the merged LSE (sink included when given).

    Returns:
        o in the outs' dtype and layout, and, with ``return_lse``, lse ``[B, H, S]`` in float32
        (float64 when outs or lses are float64). The computation runs in float32 (float64 for
        float64 inputs) and is differentiable in outs, lses and sinks. A row where every partial
        is ``-inf`` and there is no sink gives o = 0 and lse = -inf, with zero gradients.
    """
    outs, lses = _validate(outs, lses, sinks, layout, return_lse)
    out_dtype = outs[0].dtype
    cdt = torch.float64 if torch.float64 in (out_dtype, lses[0].dtype) else torch.float32
    device = outs[0].device
    neg_inf = torch.full((), float("-inf"), dtype=cdt, device=device)
    zero = torch.zeros((), dtype=cdt, device=device)
    one = torch.ones((), dtype=cdt, device=device)

    ls = [lse.to(cdt) for lse in lses]  # each [B, H, S]
    terms = list(ls)
    if sinks is not None:
        terms.append(sinks.to(cdt).view(1, -1, 1).expand_as(ls[0]))
    stacked = torch.stack(terms, dim=0)  # [n (+1), B, H, S]

    # m only stabilises exp; the result does not depend on it, so no gradient flows through it.
    m = stacked.amax(dim=0).detach()
    m = torch.where(torch.isfinite(m), m, zero)
    w = torch.exp(stacked - m)  # -inf terms: exp(-inf) = 0 with zero gradient
    denom = w.sum(dim=0)
    empty = denom <= 0  # every term is -inf: no key anywhere and no sink
    denom_safe = torch.where(empty, one, denom)
    lse = torch.where(empty, neg_inf, m + torch.log(denom_safe))

    o = None
    for i, (o_i, l_i) in enumerate(zip(outs, ls)):
        a = w[i] / denom_safe  # exp(lse_i - lse), [B, H, S]; 0 in empty rows
        if layout == "bshd":
            a = a.transpose(1, 2)
            no_key = torch.isneginf(l_i).transpose(1, 2)
        else:
            no_key = torch.isneginf(l_i)
        # A partial that saw no key contributes nothing, whatever its o holds there.
        o_c = torch.where(no_key.unsqueeze(-1), zero, o_i.to(cdt))
        term = a.unsqueeze(-1) * o_c
        o = term if o is None else o + term
    o = o.to(out_dtype)
    if return_lse:
        return o, lse
    return o
