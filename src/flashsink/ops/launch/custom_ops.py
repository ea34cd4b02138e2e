"""The kernels as ``torch.library`` custom ops: ``flashsink::fwd`` / ``flashsink::bwd``, for packed
(varlen) batches ``flashsink::varlen_fwd`` / ``flashsink::varlen_bwd``, and against a KV cache
``flashsink::kvcache_fwd`` (forward only).

They make the CUDA path of ``flashsink.attention`` traceable by ``torch.compile`` (``fullgraph=True``,
dynamic shapes): the TileLang launches are opaque to the compiler, so each direction is one op with
a fake implementation (output shapes, dtypes and strides from the inputs' shapes only) and the
forward op has an autograd formula that calls the backward op. Each op's schema is the ``schema=`` of
its ``custom_op`` below.

Arguments are tensors and primitives only; the kernels' static configuration and the problem's
``AttnSpec`` are rebuilt from them inside.

Checks: torch matches a call against the op's schema first, so a wrong type is torch's RuntimeError
naming the argument, and what the schema can convert it converts (``causal=1`` arrives as True,
``window=True`` as 1: Python's bool is an int). Every implementation, the fake ones included, then checks the
arguments with the public functions' code (``_validate``), so a bad value is the same ValueError /
TypeError as ``flashsink.attention``'s; the fakes check shapes and types only (a traced call has no
values). The ops are plain ``torch.library`` ops: nothing of torch's is subclassed or replaced.

Conventions:

* q, k, v in ``layout`` ("bhsd" or "bshd"), head dims the kernels have tiles for (32, 64, 128,
  256 on CUDA: ``kernel_attention`` zero-pads others before the op and slices o after it).
* ``window``: None or W >= 1 (keys ``[i-W+1, i]``); ``scale``: the score scale.
* o ``[B, H, S_q, D_v]`` ("bhsd") or ``[B, S_q, H, D_v]`` ("bshd"), contiguous, q's dtype.
* lse float32 (float64 for float64 inputs) ``[B, H, padded_rows(S_q)]``: the rows the backward
  kernels read; rows past ``S_q`` are padding and hold 0. ``flashsink.attention`` returns
  ``lse[:, :, :S_q]``.
* varlen: q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]`` (layout "thd"), int32 ``cu_seqlens``; o
  ``[total_q, H, D_v]``, lse ``[H, varlen_rows(total_q)]`` (padded one row tile past the last token).
* dlse: the gradient of that padded lse or None; dsink: ``[H]`` in the sinks' dtype (float32 zeros
  when ``sinks`` is None, and the autograd formula then returns no gradient).
* kvcache: ``flashsink.attention_kvcache``'s arguments (q ``[B, H, S_q, D]`` ("bhsd") or ``[B, S_q, H, D]``
  ("bshd"), a paged or contiguous cache in the same layout, int32 ``cache_seqlens`` / ``block_table``;
  with a float8_e4m3fn cache the float32 ``k_scale`` / ``v_scale``, last); o in q's layout, contiguous,
  lse ``[B, H, S_q]`` (not padded; float32, float64 for float64 inputs off CUDA). No gradient: an input that requires grad is refused when the op runs (NotImplementedError).
* precision: "fast" or "strict" (``config.PRECISIONS``). The fast backward reads the forward's o
  (the op's output, head dims as the kernels saw them), so the autograd formula saves it and the
  backward ops take it as ``o`` (last, optional: strict and the reference do not read it).

On CUDA the implementations launch the kernels. On every other device they run the reference
(forward) and its closed-form gradient (backward): ``flashsink.attention`` does not go through
them there (off CUDA it is the reference itself, plain torch ops), but ``torch.library.opcheck``
and the CPU tests of the autograd wiring do.

Importing this module registers the ops; it never imports tilelang (kernels build on first launch).
"""

import torch

from ... import reference
from ... import _validate
from ..._validate import AttnSpec
from ..._validate_kvcache import check_kvcache_op, refuse_grad
from . import dense
from ...kernel_config import NATIVE_HEAD_DIMS, padded_rows, varlen_rows
from .kvcache import kernel_attention_kvcache

__all__ = ["fwd", "bwd", "varlen_fwd", "varlen_bwd", "kvcache_fwd"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(spec: AttnSpec) -> bool:
    return 0 in (spec.batch, spec.heads, spec.seq_q, spec.seq_kv)


def _kernel_inputs(spec: AttnSpec, deterministic: bool, precision: str, q, k, v, sinks, cu_seqlens=None):
    """``dense.prepare``'s plan, q, k, v (contiguous; no-ops from kernel_attention) and float32 sinks,
    after the ops' own condition: head dims the kernels have, unpadded. ``cu_seqlens``: the varlen
    ops' ``(cu_q, cu_k)``."""
    if cu_seqlens is not None:
        cu_seqlens = (cu_seqlens[0].contiguous(), cu_seqlens[1].contiguous())
    plan, q, k, v, sinks32 = dense.prepare(spec, q, k, v, sinks, deterministic=deterministic, precision=precision,
                                           cu_seqlens=cu_seqlens, pad=False)
    cfg = plan.cfg
    # the config's head dims are the rule's (config.kernel_head_dim): the ops take them unpadded only
    if cfg.head_dim != spec.head_dim or cfg.head_dim_v != spec.head_dim_v:
        name, d = ("q/k", spec.head_dim) if cfg.head_dim != spec.head_dim else ("v", spec.head_dim_v)
        raise ValueError(
            f"the flashsink kernel ops take head dims {NATIVE_HEAD_DIMS} on CUDA (flashsink.attention and "
            f"attention_varlen zero-pad the others); the {name} head dim is {d}"
        )
    return plan, q, k, v, sinks32


# ------------------------------------------------------------------------------------------------
# Forward


def _fwd_reference(q, k, v, sinks, window, causal, scale, layout, deterministic, precision="fast"):
    """Reference implementation (every device but CUDA): o and the row-padded lse (``precision`` changes
    nothing here: the reference is exact in its compute dtype)."""
    spec = _validate.check_op(q, k, v, sinks, window, causal, scale, layout)  # the ops are public names
    _validate.check_op_options(deterministic, precision)
    o, lse = reference.attention_validated(q, k, v, sinks, spec, return_lse=True)
    rows = padded_rows(spec.seq_q)
    return o.contiguous(), torch.nn.functional.pad(lse, (0, rows - spec.seq_q))


fwd = torch.library.custom_op("flashsink::fwd", _fwd_reference, mutates_args=(), schema=(
    '(Tensor q, Tensor k, Tensor v, Tensor? sinks, SymInt? window, bool causal, float scale, str layout, '
    'bool deterministic, str precision="fast") -> (Tensor, Tensor)'))


@fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, sinks, window, causal, scale, layout, deterministic, precision="fast"):
    spec = _validate.check_op(q, k, v, sinks, window, causal, scale, layout)  # the ops are public names
    _validate.check_op_options(deterministic, precision)
    if _empty(spec):
        return _fwd_reference(q, k, v, sinks, window, causal, scale, layout, deterministic, precision)
    plan, q, k, v, sinks32 = _kernel_inputs(spec, deterministic, precision, q, k, v, sinks)
    o, lse = dense.forward(plan, q, k, v, sinks32)
    if lse.shape[-1] > spec.seq_q:  # the padding rows: some are never written by the kernel
        lse[:, :, spec.seq_q:] = 0
    return o, lse


@fwd.register_fake
def _fwd_fake(q, k, v, sinks, window, causal, scale, layout, deterministic, precision="fast"):
    spec = _validate.check_op(q, k, v, sinks, window, causal, scale, layout)  # the ops are public names
    _validate.check_op_options(deterministic, precision)
    o = q.new_empty(_validate.out_shape(spec, q))
    lse = q.new_empty((spec.batch, spec.heads, padded_rows(spec.seq_q)), dtype=_lse_dtype(q.dtype))
    return o, lse


# ------------------------------------------------------------------------------------------------
# Backward


def _bwd_reference(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout, deterministic, precision="fast",
                   o=None):
    """Reference implementation (every device but CUDA): the closed-form gradient (o is not read)."""
    spec = _validate.check_bwd_op(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout)
    _validate.check_op_options(deterministic, precision, o)
    dlse = None if dlse is None else dlse[:, :, : spec.seq_q]
    return _reference_backward(do, q, k, v, sinks, dlse, spec)


bwd = torch.library.custom_op("flashsink::bwd", _bwd_reference, mutates_args=(), schema=(
    '(Tensor do, Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor lse, Tensor? dlse, SymInt? window, '
    'bool causal, float scale, str layout, bool deterministic, str precision="fast", '
    'Tensor? o=None) -> (Tensor, Tensor, Tensor, Tensor)'))


@bwd.register_kernel("cuda")
def _bwd_cuda(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout, deterministic, precision="fast", o=None):
    spec = _validate.check_bwd_op(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout)
    _validate.check_op_options(deterministic, precision, o)
    if _empty(spec):
        return _bwd_reference(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout, deterministic)
    plan, q, k, v, sinks32 = _kernel_inputs(spec, deterministic, precision, q, k, v, sinks)
    return _kernel_backward(plan, do.contiguous(), q, k, v, o, lse.contiguous(), dlse, sinks, sinks32)


def _kernel_backward(plan, do, q, k, v, o, lse, dlse, sinks, sinks32):
    """The CUDA backward ops' launch: dq, dk, dv and dsink in sinks' dtype (float32 zeros without sinks)."""
    o = _saved_output(o, plan.cfg)
    dq, dk, dv, dsink = dense.backward(plan, do, q, k, v, o, lse, dlse, sinks32)
    if dsink is None:
        return dq, dk, dv, sinks32.new_zeros(plan.spec.heads)
    return dq, dk, dv, dsink.to(sinks.dtype)


@bwd.register_fake
def _bwd_fake(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout, deterministic, precision="fast", o=None):
    spec = _validate.check_bwd_op(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout)
    _validate.check_op_options(deterministic, precision, o)
    heads = spec.heads
    dsink_dtype = torch.float32 if sinks is None else sinks.dtype
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty((heads,), dtype=dsink_dtype)


def _reference_backward(do, q, k, v, sinks, dlse, spec: AttnSpec):
    """dq, dk, dv, dsink of the reference in closed form, in its compute dtype.

    Autograd cannot run inside an op's implementation (the dispatcher is below autograd there), so
    this is FlashAttention's backward written out: P = exp(S - lse) on visible pairs,
    dP = dO V^T, Delta = rowsum(P * dP) - dlse, dS = P * (dP - Delta), dQ = scale dS K,
    dK = scale dS^T Q, dV = P^T dO, dsink = -sum_rows exp(sink - lse) * Delta.
    """
    cdt = reference.resolve_compute_dtype(q.dtype, None)
    if spec.layout == "bshd":
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    b, hk, g, sq, skv = spec.batch, spec.kv_heads, spec.groups, spec.seq_q, spec.seq_kv
    _, lse = reference.attention_bhsd(q, k, v, sinks, spec, cdt)  # [B, H, Sq]
    lse = lse.view(b, hk, g, sq)
    visible = reference.visible_mask(sq, skv, window=spec.window, causal=spec.causal, device=q.device)
    # the finite parts only, as the forward: a masked key's NaN never meets a zero (reference.finite_part)
    (qc, _), (kc, _), (vc, v_bad) = (reference.finite_part(t.to(cdt)) for t in (q, k, v))
    qc = qc.reshape(b, hk, g * sq, spec.head_dim)
    doc = do.to(cdt).reshape(b, hk, g, sq, spec.head_dim_v)  # no gradient through the NaN entries of o:
    doc = torch.where(reference.seen_bad(v_bad, visible).unsqueeze(2), 0, doc).reshape(b, hk, g * sq, -1)

    s = torch.matmul(qc, kc.transpose(-1, -2)).view(b, hk, g, sq, skv) * spec.scale
    keep = visible & torch.isfinite(lse).unsqueeze(-1)  # lse = -inf: a row with no key and no sink
    zero = torch.zeros((), dtype=cdt, device=q.device)
    p = torch.where(keep, torch.exp(s - lse.unsqueeze(-1)), zero)  # [B, Hk, G, Sq, Skv]
    dp = torch.matmul(doc, vc.transpose(-1, -2)).view(b, hk, g, sq, skv)
    delta = (p * dp).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.to(cdt).view(b, hk, g, sq)
    ds = (p * (dp - delta.unsqueeze(-1))).view(b, hk, g * sq, skv)
    p = p.view(b, hk, g * sq, skv)

    dq = (torch.matmul(ds, kc) * spec.scale).view(b, spec.heads, sq, spec.head_dim)
    dk = torch.matmul(ds.transpose(-1, -2), qc) * spec.scale  # sums the G query heads of each KV head
    dv = torch.matmul(p.transpose(-1, -2), doc)
    if sinks is not None:
        p_sink = torch.exp(sinks.to(cdt).view(1, hk, g, 1) - lse)
        dsink = -(p_sink * delta).sum(dim=(0, 3)).reshape(spec.heads).to(sinks.dtype)
    else:
        dsink = torch.zeros(spec.heads, dtype=torch.float32, device=q.device)
    if spec.layout == "bshd":
        dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsink


# ------------------------------------------------------------------------------------------------
# Autograd: the forward op's formula calls the backward op


def _saved_output(o, cfg):
    """o for the fast backward (which reads it), None for strict (which does not)."""
    if cfg.precision == "strict":
        return None
    if o is None:
        raise ValueError('precision="fast": the backward op needs the forward\'s output o (the argument o)')
    return o.contiguous()


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, window, causal, scale, layout, deterministic, *precision = inputs
    precision = precision[0] if precision else "fast"
    o, lse = output
    # strict recomputes Delta from P and dP: o is not kept; fast reads it (Delta = rowsum(dO * O))
    ctx.save_for_backward(q, k, v, sinks, lse, None if precision == "strict" else o)
    ctx.options = (window, causal, scale, layout, deterministic, precision)


def _backward(ctx, do, dlse):
    q, k, v, sinks, lse, o = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.flashsink.bwd(do, q, k, v, sinks, lse, dlse, *ctx.options, o)
    return dq, dk, dv, (None if sinks is None else dsink), None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# Varlen (layout "thd"): flashsink::varlen_fwd / flashsink::varlen_bwd
#
# The same pattern for packed batches. cu_seqlens_q/k are int32 tensors that only the
# implementations read (the kernels on the device, the reference on the host), so no value of
# them reaches the graph; max_seqlen_q/k are ints (SymInts when traced) that the host reads (the
# kernels' grids come from shapes, ops/tir/schedule.py).
# Output shapes depend on total tokens, heads and head dims only: o [total_q, H, D_v],
# lse [H, varlen_rows(total_q)] (row-padded as the backward kernels read it; padding rows 0).


def _varlen_empty(spec: AttnSpec, q, k) -> bool:
    return 0 in (spec.batch, q.shape[0], k.shape[0])


def _varlen_fwd_reference(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal,
                          scale, deterministic, precision="fast"):
    """Reference implementation (every device but CUDA): the varlen reference, lse row-padded."""
    spec = _validate.check_varlen_op(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                                     causal, scale)
    _validate.check_op_options(deterministic, precision)
    # the offsets are read inside the op: never in a graph
    o, lse = reference.attention_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, spec, return_lse=True)
    total = q.shape[0]
    return o.contiguous(), torch.nn.functional.pad(lse, (0, varlen_rows(total) - total))


varlen_fwd = torch.library.custom_op("flashsink::varlen_fwd", _varlen_fwd_reference, mutates_args=(), schema=(
    '(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor cu_seqlens_q, Tensor cu_seqlens_k, '
    'SymInt max_seqlen_q, SymInt max_seqlen_k, SymInt? window, bool causal, float scale, bool deterministic, '
    'str precision="fast") -> (Tensor, Tensor)'))


@varlen_fwd.register_kernel("cuda")
def _varlen_fwd_cuda(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal, scale,
                     deterministic, precision="fast"):
    spec = _validate.check_varlen_op(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                                     causal, scale)
    _validate.check_op_options(deterministic, precision)
    if _varlen_empty(spec, q, k):
        return _varlen_fwd_reference(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     window, causal, scale, deterministic)
    plan, q, k, v, sinks32 = _kernel_inputs(spec, deterministic, precision, q, k, v, sinks,
                                            (cu_seqlens_q, cu_seqlens_k))
    o, lse = dense.forward(plan, q, k, v, sinks32)
    lse[:, q.shape[0]:] = 0  # the padding rows: some are never written by the kernel
    return o, lse


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal, scale,
                     deterministic, precision="fast"):
    _validate.check_varlen_op(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal,
                              scale, values=False)  # a fake has no values
    _validate.check_op_options(deterministic, precision)
    total, heads = q.shape[0], q.shape[1]
    o = q.new_empty((total, heads, v.shape[2]))
    lse = q.new_empty((heads, varlen_rows(total)), dtype=_lse_dtype(q.dtype))
    return o, lse


def _varlen_bwd_reference(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          window, causal, scale, deterministic, precision="fast", o=None):
    """Reference implementation (every device but CUDA): the closed-form gradient, one sequence at a time."""
    spec = _validate.check_varlen_bwd_op(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, window, causal, scale)
    _validate.check_op_options(deterministic, precision, o)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    acc = _lse_dtype(q.dtype)  # the reference's compute dtype: dsink is summed over sequences in it
    s_acc = None if sinks is None else sinks.to(acc)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsink = torch.zeros(spec.heads, dtype=acc, device=q.device)
    for i in range(spec.batch):
        a, b, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if a == b:
            continue  # no query rows: no gradient from this sequence
        dl = None if dlse is None else dlse[:, a:b].unsqueeze(0)
        gq, gk, gv, gs = _reference_backward(do[a:b][None], q[a:b][None], k[c:e][None], v[c:e][None], s_acc, dl,
                                             spec.one_sequence(b - a, e - c))
        dq[a:b], dk[c:e], dv[c:e] = gq[0], gk[0], gv[0]
        dsink += gs
    if sinks is None:
        return dq, dk, dv, dsink.new_zeros(spec.heads, dtype=torch.float32)
    return dq, dk, dv, dsink.to(sinks.dtype)


varlen_bwd = torch.library.custom_op("flashsink::varlen_bwd", _varlen_bwd_reference, mutates_args=(), schema=(
    '(Tensor do, Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor lse, Tensor? dlse, Tensor cu_seqlens_q, '
    'Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, SymInt? window, bool causal, '
    'float scale, bool deterministic, str precision="fast", Tensor? o=None) -> (Tensor, Tensor, Tensor, '
    'Tensor)'))


@varlen_bwd.register_kernel("cuda")
def _varlen_bwd_cuda(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                     causal, scale, deterministic, precision="fast", o=None):
    spec = _validate.check_varlen_bwd_op(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, window, causal, scale)
    _validate.check_op_options(deterministic, precision, o)
    if _varlen_empty(spec, q, k):
        return _varlen_bwd_reference(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, window, causal, scale, deterministic)
    plan, q, k, v, sinks32 = _kernel_inputs(spec, deterministic, precision, q, k, v, sinks,
                                            (cu_seqlens_q, cu_seqlens_k))
    return _kernel_backward(plan, do.contiguous(), q, k, v, o, lse.contiguous(), dlse, sinks, sinks32)


@varlen_bwd.register_fake
def _varlen_bwd_fake(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                     causal, scale, deterministic, precision="fast", o=None):
    _validate.check_varlen_bwd_op(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, window, causal, scale, values=False)
    _validate.check_op_options(deterministic, precision, o)
    dsink_dtype = torch.float32 if sinks is None else sinks.dtype
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((q.shape[1],), dtype=dsink_dtype))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_q, cu_k, *options = inputs
    if len(options) == 6:
        options.append("fast")  # max_seqlen_q, max_seqlen_k, window, causal, scale, deterministic, precision
    o = None if options[-1] == "strict" else output[0]  # as _setup_context
    ctx.save_for_backward(q, k, v, sinks, output[1], cu_q, cu_k, o)
    ctx.options = options


def _varlen_backward(ctx, do, dlse):
    q, k, v, sinks, lse, cu_q, cu_k, o = ctx.saved_tensors
    dq, dk, dv, dsink = torch.ops.flashsink.varlen_bwd(do, q, k, v, sinks, lse, dlse, cu_q, cu_k, *ctx.options, o)
    return (dq, dk, dv, None if sinks is None else dsink) + (None,) * 9


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ------------------------------------------------------------------------------------------------
# KV cache: flashsink::kvcache_fwd (forward only)
#
# cache_seqlens and block_table are int32 tensors that only the implementations read (the kernels
# on the device, the reference on the host after check_cache_values), so no value of them reaches a
# graph: batch, S_q, the number of pages, the page size and max_pages are sizes (SymInts when traced).


def _kvcache_fwd_reference(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout,
                           k_scale=None, v_scale=None):
    """Reference implementation (every device but CUDA), the values of the lengths, pages and scales checked on
    the host."""
    spec = check_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale,
                            v_scale)
    # the values are read inside the op: never in a graph
    o, lse = reference.attention_kvcache_validated(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec,
                                                   return_lse=True, k_scale=k_scale, v_scale=v_scale)
    return o.contiguous(), lse.contiguous()


kvcache_fwd = torch.library.custom_op("flashsink::kvcache_fwd", _kvcache_fwd_reference, mutates_args=(), schema=(
    '(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, Tensor? sinks, '
    'SymInt? window, float scale, str layout, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor)'))


@kvcache_fwd.register_kernel("cuda")
def _kvcache_fwd_cuda(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale=None,
                      v_scale=None):
    spec = check_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale,
                            v_scale)
    return kernel_attention_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, return_lse=True,
                                    k_scale=k_scale, v_scale=v_scale)


@kvcache_fwd.register_fake
def _kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale=None,
                      v_scale=None):
    spec = check_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale,
                            v_scale)
    o = q.new_empty((spec.batch, spec.seq_q, spec.heads, spec.head_dim_v) if spec.layout == "bshd"
                    else (spec.batch, spec.heads, spec.seq_q, spec.head_dim_v))
    return o, q.new_empty((spec.batch, spec.heads, spec.seq_q), dtype=_lse_dtype(q.dtype))


def _kvcache_refuse_grad(ctx, inputs, output):
    """Forward only: called when grad mode is on and an input requires grad (the implementations run
    below autograd, with grad mode off, so their own check cannot see it)."""
    q, k_cache, v_cache, _, _, sinks, _, _, _, k_scale, v_scale = inputs
    refuse_grad(q, k_cache, v_cache, sinks, k_scale, v_scale)


kvcache_fwd.register_autograd(None, setup_context=_kvcache_refuse_grad)
