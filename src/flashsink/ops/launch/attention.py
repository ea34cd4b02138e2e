"""``flashsink.attention`` / ``attention_varlen`` on CUDA tensors: head-dim padding, then the launches.

Two routes to the same launches (``dense.forward`` / ``dense.backward``, after ``dense.prepare``):

* eagerly (the common case), :class:`_Attention`, a plain ``torch.autograd.Function`` that calls
  the launchers itself: no custom-op dispatch, no re-derivation of the problem from the tensors'
  shapes, a few microseconds of Python per direction;
* under ``torch.compile`` (``torch.compiler.is_compiling()``), the custom ops ``flashsink::fwd`` /
  ``bwd`` / ``varlen_fwd`` / ``varlen_bwd`` (``custom_ops.py``), whose fake implementations let the
  compiler trace around the kernels (their host cost is then inside the compiled graph's call).

Both give the same tensors: o in q's layout and dtype, lse float32 over the real rows, gradients for
q, k, v and the sinks (in the sinks' dtype). Validation happened once, in ``flashsink.api``.
"""

import torch

from . import custom_ops  # noqa: F401  (registers the flashsink:: ops)
from . import dense


def _eager(q) -> bool:
    """The autograd.Function route: CUDA tensors outside a torch.compile trace. (Other devices take
    the ops, whose implementation there is the reference; lab/host_overhead.py and the CPU tests
    of the launches turn this on for CPU tensors.)"""
    return q.is_cuda and not torch.compiler.is_compiling()


class _Attention(torch.autograd.Function):
    """The eager route: forward and backward launches on kernel-ready tensors (``dense.prepare``'s:
    contiguous, head dims the kernels' own) for a ``dense.Plan``. Returns o and the row-padded lse
    the backward reads (its padding rows unwritten: callers that return lse slice it to the real
    rows; a slice per call costs microseconds, so the common call that returns only o takes none)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, sinks32):
        # (sinks: the autograd input; sinks32, prepare's float32 copy or sinks itself, what the kernels read)
        # the backward's Delta = rowsum(dO * O): fast reads o; strict the forward's fp32 O where it has one
        # (``config.fwd_o32``), else (None) recomputes Delta from P and dP
        if plan.cfg.precision == "strict":
            o, lse, saved = dense.forward(plan, q, k, v, sinks32, o32=True)
        else:
            o, lse = dense.forward(plan, q, k, v, sinks32)
            saved = o
        ctx.save_for_backward(q, k, v, saved, lse, sinks32)
        ctx.problem = (plan, None if sinks is None else sinks.dtype)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks32 = ctx.saved_tensors
        plan, sinks_dtype = ctx.problem
        if do is None:  # only lse was used
            do = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        elif not do.is_contiguous():
            do = do.contiguous()
        dq, dk, dv, dsink = dense.backward(plan, do, q, k, v, o, lse, dlse, sinks32)
        if dsink is not None and dsink.dtype != sinks_dtype:
            dsink = dsink.to(sinks_dtype)
        return dq, dk, dv, dsink, None, None


def _launch(plan, q, k, v, sinks, sinks32):
    """The eager route; without gradients, no autograd node at all. o and the row-padded lse."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _Attention.apply(q, k, v, sinks, plan, sinks32)
    return dense.forward(plan, q, k, v, sinks32)


def kernel_attention(spec, q, k, v, sinks, *, return_lse=False, deterministic=False, precision="fast"):
    """Run validated inputs through the kernels (autograd for q, k, v and sinks).

    Traceable by torch.compile (fullgraph, dynamic shapes) through the custom op ``flashsink::fwd``,
    whose autograd formula calls ``flashsink::bwd``. Head-dim padding and the slicing of o and lse
    are plain torch ops around the launches, so autograd slices and pads the gradients.
    """
    if 0 in (spec.batch, spec.heads, spec.seq_q, spec.seq_kv):
        # Empty problems (no rows, or no keys: o = 0 and lse = the sink) have no tiles to
        # launch; the reference gives their exact, differentiable result on q's device (after
        # the kernels' refusal, as for any problem).
        dense.check_supported(spec)
        from ... import reference

        return reference.attention_validated(q, k, v, sinks, spec, return_lse=return_lse)
    if _eager(q):
        plan, q, k, v, sinks32 = dense.prepare(spec, q, k, v, sinks, deterministic=deterministic,
                                               precision=precision)
        o, lse = _launch(plan, q, k, v, sinks, sinks32)
        if return_lse:  # the real rows of the row-padded lse (autograd pads dlse back)
            lse = lse[:, :, : spec.seq_q]
    else:
        dense.check_supported(spec)  # (the eager route's is prepare's)
        q, k, v = dense.pad_head_dims(spec, q, k, v)
        # lse comes back with padded_rows(seq_q) rows (the layout the backward kernels read).
        o, lse = torch.ops.flashsink.fwd(
            q, k, v, sinks, spec.window, spec.causal, spec.scale, spec.layout, deterministic, precision
        )
        lse = lse[:, :, : spec.seq_q]
    if o.shape[-1] != spec.head_dim_v:
        o = o[..., : spec.head_dim_v]
    return (o, lse) if return_lse else o


def kernel_attention_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *, return_lse=False,
                            deterministic=False, precision="fast", pad_head_dims=None):
    """A validated packed batch through the kernels (autograd as :func:`kernel_attention`; traced:
    ``flashsink::varlen_fwd`` / ``varlen_bwd``). On CUDA the head dims are zero-padded to the kernels'
    sizes (``pad_head_dims``, default: on CUDA only; the ops' CPU implementation is the reference and
    takes any head dim).
    """
    if pad_head_dims is None:
        pad_head_dims = q.is_cuda
    cu_q = cu_seqlens_q.to(torch.int32)  # what the kernels read; a no-op for int32 offsets
    cu_k = cu_seqlens_k.to(torch.int32)
    if _eager(q) and spec.batch > 0 and q.shape[0] > 0 and k.shape[0] > 0:
        plan, q, k, v, sinks32 = dense.prepare(spec, q, k, v, sinks, deterministic=deterministic, precision=precision,
                                               cu_seqlens=(cu_q.contiguous(), cu_k.contiguous()), pad=pad_head_dims)
        o, lse = _launch(plan, q, k, v, sinks, sinks32)
        if return_lse:
            lse = lse[:, : q.shape[0]]
    else:
        if q.is_cuda:  # (the ops' CPU implementation is the reference: any dtype and head dim)
            dense.check_supported(spec)
        if pad_head_dims:
            q, k, v = dense.pad_head_dims(spec, q, k, v)
        o, lse = torch.ops.flashsink.varlen_fwd(
            q, k, v, sinks, cu_q, cu_k, spec.seq_q, spec.seq_kv, spec.window, spec.causal, spec.scale,
            deterministic, precision,
        )
        lse = lse[:, : q.shape[0]]
    if o.shape[-1] != spec.head_dim_v:
        o = o[..., : spec.head_dim_v]
    return (o, lse) if return_lse else o
