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

The algebra lives in :func:`merge_stacked`, on partials stacked next to the head dim
(``[.., n, D]``): :func:`combine` stacks its lists once, and the split-KV decode
(``flashsink.ops.launch.decode``) passes its kernel's partials, already in that layout. Either way a
fixed number of PyTorch ops, whatever the number of partials.
"""

from __future__ import annotations

import torch

from ._validate import LAYOUTS, check_choice, check_flags, check_tensor, shape_text

__all__ = ["combine"]


def _check_list(name: str, xs) -> list:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of torch.Tensor, got {type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{name} must hold at least one partial result, got an empty {type(xs).__name__}")
    for i, t in enumerate(xs):
        check_tensor(f"{name}[{i}]", t)
    return list(xs)


def _check_partials(name, items, shape, device, *, shape_error, device_error) -> None:
    """ValueError unless every tensor of ``items`` (the list argument ``name``) has ``shape``, the first
    one's dtype and ``device``; ``shape_error(i, t)`` / ``device_error(i, t)`` say what is wrong."""
    first = items[0]
    for i, t in enumerate(items):
        if tuple(t.shape) != shape:
            raise ValueError(shape_error(i, t))
        if t.dtype != first.dtype:
            raise ValueError(f"{name} must share one dtype, got {name}[0] {first.dtype} and {name}[{i}] {t.dtype}")
        if t.device != device:
            raise ValueError(device_error(i, t))


def _validate(outs, lses, sinks, layout, return_lse):
    outs = _check_list("outs", outs)
    lses = _check_list("lses", lses)
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have one entry per partial result, got {len(outs)} outs and {len(lses)} lses"
        )
    check_choice("layout", layout, LAYOUTS)
    check_flags(return_lse=return_lse)

    what = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    o0 = outs[0]
    if o0.dim() != 4:
        raise ValueError(f"outs[0] must be 4-D {what} for layout={layout!r}, got {o0.dim()}-D shape {shape_text(o0)}")
    device = o0.device
    _check_partials(
        "outs", outs, tuple(o0.shape), device,
        shape_error=lambda i, o: f"outs[{i}] must have the shape of outs[0] {shape_text(o0)} (partials over the same "
        f"queries), got {shape_text(o)}",
        device_error=lambda i, o: f"outs must be on one device, got outs[0] on {device} and outs[{i}] on {o.device}",
    )

    if layout == "bhsd":
        b, h, s, _ = o0.shape
    else:
        b, s, h, _ = o0.shape
    _check_partials(
        "lses", lses, (b, h, s), device,
        shape_error=lambda i, lse: f"lses[{i}] must be [B, H, S] = [{b}, {h}, {s}] to match outs ({layout} "
        f"{shape_text(o0)}), got {shape_text(lse)}",
        device_error=lambda i, lse: f"lses[{i}] must be on the device of outs ({device}), got {lse.device}",
    )
    if sinks is not None:
        check_tensor("sinks", sinks)
        if sinks.dim() != 1 or sinks.shape[0] != h:
            raise ValueError(
                f"sinks must be 1-D of shape [{h}] (one logit per head of outs), got shape {shape_text(sinks)}"
            )
        if sinks.device != device:
            raise ValueError(f"sinks must be on the device of outs ({device}), got {sinks.device}")
    return outs, lses


def _check_lse_values(stacked: torch.Tensor, lses) -> None:
    """ValueError naming the first partial whose lse holds +inf or NaN: ``-inf`` is a row that saw no
    key of that range (valid); +inf or NaN is no log-sum-exp of finite scores and would make the row
    NaN silently. ``stacked``: the lses stacked (``[.., n]``); one reduction and one read on the host
    whatever the number of partials; skipped while torch.compile traces and on meta tensors."""
    if torch.compiler.is_compiling() or stacked.device.type == "meta" or stacked.numel() == 0:
        return
    top = stacked.detach().amax().item()  # NaN if any is NaN, +inf if any is +inf
    if top == top and top != float("inf"):
        return
    for i, lse in enumerate(lses):  # the error's details only
        bad = torch.isnan(lse) | torch.isposinf(lse)
        if bad.any():
            first = [int(x) for x in bad.nonzero()[0]]
            raise ValueError(
                f"lses[{i}] must hold finite values or -inf (a row that saw no key of that range), got "
                f"{int(bad.sum())} entries +inf or NaN, the first at [b, h, s] = {first}: {lse[tuple(first)].item()}"
            )


def merge_stacked(o: torch.Tensor, terms: torch.Tensor):
    """The merge algebra on stacked partials, in a fixed number of PyTorch ops (no loop over them).

    Args:
        o: ``[*rows, n, D]`` the partial outputs, any float dtype; the entry of a partial whose
            LSE is ``-inf`` in a row is ignored there (it may hold anything, NaN included).
        terms: ``[*rows, n]`` the partials' LSEs (no sink in them), or ``[*rows, n + 1]`` whose
            last column is the sink: a term with no value, which only adds to the normaliser. The
            computation runs in ``terms``' dtype (callers cast it), differentiably.

    Returns:
        o ``[*rows, D]`` and lse ``[*rows]``, both in ``terms``' dtype:
        ``lse = log sum_t exp(terms_t)`` and ``o = sum_i exp(lse_i - lse) o_i``. Like the
        reference: a row whose terms are all ``-inf`` gives o = 0 and lse = -inf with zero
        gradients; a ``+inf`` term with no value (a +inf sink) gives o = 0 and lse = +inf; a NaN
        term makes the row NaN; a NaN in ``o_i`` where ``lse_i`` is finite reaches the output.
    """
    n = o.shape[-2]
    lse_i = terms[..., :n]
    # The pivot only keeps exp in range: the result does not depend on it, so no gradient flows
    # through it. Where the largest term is not finite (-inf: no term at all; +inf; NaN) it is 0,
    # as in the reference (there too, a +inf sink beside a score past exp's range, ~88 in fp32,
    # gives NaN: exp(lse_i) = inf here, exp(s_j) = inf there).
    top = terms.detach().amax(dim=-1, keepdim=True)  # [*rows, 1]
    w = torch.exp(terms - top.nan_to_num(0.0, 0.0, 0.0))  # -inf terms: 0 with zero gradient
    denom = w.sum(dim=-1, keepdim=True)
    # denom >= 1 where some term is finite (the largest one adds exp(0) = 1), inf with a +inf term,
    # NaN with a NaN one, and 0 only where every term is -inf. Clamping that 0 to 1 (zero gradient
    # below 1) leaves a = 0 and lse = -inf + log 1 there, both with finite, zero gradients.
    denom = denom.clamp_min(1.0)
    lse = top.nan_to_num(0.0, 0.0, float("-inf")) + torch.log(denom)
    a = w[..., :n] / denom  # exp(lse_i - lse), [*rows, n]
    o = torch.where(torch.isneginf(lse_i).unsqueeze(-1), 0.0, o)
    o = (a.unsqueeze(-1) * o).sum(dim=-2)  # promotes o to the computation's dtype in the product
    return o, lse.squeeze(-1)


def combine(outs, lses, sinks=None, *, layout="bhsd", return_lse=False):
    """Merge partial attention results over disjoint key ranges, applying each head's sink once.

    Args:
        outs: list of partial outputs, each ``[B, H, S, D]`` (layout "bhsd") or ``[B, S, H, D]``
            ("bshd"), one shape, dtype and device for all.
        lses: list of the partials' natural-log LSEs (no sink in them), float ``[B, H, S]`` in both
            layouts, one per entry of ``outs``; ``-inf`` marks a row that saw no key of that range
            (its ``o`` is ignored there). ``+inf`` or NaN is a ValueError naming the partial (read on
            the host: one reduction per partial, skipped while torch.compile traces).
        sinks: ``[H]`` sink logits (any float dtype) applied once, or None (the result is then a
            partial again, which can itself be combined later).
        layout: "bhsd" or "bshd", the layout of ``outs`` and of the returned o.
        return_lse: also return the merged LSE (sink included when given).

    Returns:
        o in the outs' dtype and layout, and, with ``return_lse``, lse ``[B, H, S]`` in float32
        (float64 when outs or lses are float64). The computation runs in float32 (float64 for
        float64 inputs) and is differentiable in outs, lses and sinks. A row where every partial
        is ``-inf`` and there is no sink gives o = 0 and lse = -inf, with zero gradients.
        Non-finite sinks as in :func:`flashsink.reference.attention`: a ``-inf`` sink is no sink,
        a ``+inf`` sink takes all the weight (o = 0, lse = +inf), a NaN sink makes its head NaN.
        NaN in a partial's o where its lse is finite reaches the output.

    The partials are stacked once (``[.., n, D]``) and merged by :func:`merge_stacked`, the same
    code the split-KV decode uses: a fixed number of ops for any number of partials.
    """
    outs, lses = _validate(outs, lses, sinks, layout, return_lse)
    return _merge(outs, lses, sinks, layout, return_lse, check=True)


def merge_partials(outs, lses, sinks=None, *, layout="bhsd", return_lse=False):
    """:func:`combine` without its checks, for flashsink's own partials (the ring's, whose per-step merge
    must not wait on the host): a NaN lse makes its row NaN, a +inf one takes the row's weight."""
    return _merge(outs, lses, sinks, layout, return_lse, check=False)


def _merge(outs, lses, sinks, layout, return_lse, check):
    out_dtype = outs[0].dtype
    cdt = torch.float64 if torch.float64 in (out_dtype, lses[0].dtype) else torch.float32

    terms = [lse.to(cdt) for lse in lses]  # each [B, H, S]
    if sinks is not None:
        terms.append(sinks.to(cdt).view(1, -1, 1).expand_as(terms[0]))
    terms = torch.stack(terms, dim=-1)  # [B, H, S, n (+1)]
    if check:
        _check_lse_values(terms[..., : len(lses)], lses)
    if layout == "bshd":
        terms = terms.transpose(1, 2)  # rows in the outs' order, [B, S, H, n (+1)]
    o, lse = merge_stacked(torch.stack(outs, dim=-2), terms)  # outs stacked: [B, *, *, n, D]
    o = o.to(out_dtype)
    if layout == "bshd":
        lse = lse.transpose(1, 2).contiguous()
    if return_lse:
        return o, lse
    return o
