"""Public entry points: validate once, then dispatch to the TileLang kernels (CUDA) or the reference."""

from __future__ import annotations

import torch

from . import reference
from ._validate import check_flags, check_precision, validate_attention, validate_varlen
from ._validate_kvcache import validate_kvcache
from .ops.launch.attention import kernel_attention, kernel_attention_varlen  # registers the ops; never imports tilelang
from .ops.launch.kvcache import kernel_attention_kvcache

__all__ = ["attention", "attention_kvcache", "attention_varlen"]


def attention(
    q,
    k,
    v,
    sinks=None,
    *,
    window=None,
    causal=True,
    scale=None,
    layout="bhsd",
    return_lse=False,
    deterministic=False,
    precision="fast",
):
    """Attention with learnable sinks; differentiable in q, k, v and sinks.

    Args:
        q: ``[B, H, S_q, D]`` (layout "bhsd") or ``[B, S_q, H, D]`` (layout "bshd").
        k, v: ``[B, H_kv, S_kv, D]`` / ``[B, H_kv, S_kv, D_v]`` (or the "bshd" order); ``H % H_kv == 0``.
        sinks: ``[H]`` sink logits (one per query head) or None.
        window: sliding window W, keys ``[i-W+1, i]`` (FlashAttention ``window_size=(W-1, 0)``);
            needs ``causal=True``.
        causal: causal mask, bottom-right aligned when ``S_q != S_kv``.
        scale: score scale, default ``1/sqrt(D)``.
        return_lse: also return the natural-log LSE including the sink, float32 ``[B, H, S_q]``.
        deterministic: ask the CUDA backward for a deterministic reduction order.
        precision: ``"fast"`` (default: single-term fp16/bf16 products in the CUDA backward, Delta from
            the saved output, the error class of FlashAttention/FLA/flex) or ``"strict"`` (two-term
            products, Delta from P and dP: the precision standard). README, "Precision modes". Off
            CUDA it changes nothing: the reference is exact in its compute dtype.

    CUDA tensors run the TileLang kernels (through the custom ops ``flashsink::fwd`` / ``flashsink::bwd``);
    tensors on any other device run the PyTorch reference. Both paths trace with
    ``torch.compile(fullgraph=True, dynamic=True)``.
    """
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    check_flags(return_lse=return_lse, deterministic=deterministic)
    check_precision(precision)
    if q.is_cuda:
        return kernel_attention(
            spec, q, k, v, sinks, return_lse=return_lse, deterministic=deterministic, precision=precision
        )
    return reference.attention_validated(q, k, v, sinks, spec, return_lse=return_lse)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sinks=None,
    *,
    window=None,
    causal=True,
    scale=None,
    return_lse=False,
    deterministic=False,
    precision="fast",
):
    """Varlen (THD) attention with sinks: q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]``.

    Sequence i is rows ``cu_seqlens[i]:cu_seqlens[i+1]``; masks apply within each sequence,
    bottom-right aligned per sequence. lse (with ``return_lse``) is float32 ``[H, total_q]``.
    ``max_seqlen_q`` / ``max_seqlen_k`` are ints (at least the longest sequence). ``precision`` as in
    :func:`attention` (ignored off CUDA).

    CUDA tensors run the kernels through the custom ops ``flashsink::varlen_fwd`` / ``varlen_bwd``;
    tensors on other devices run the reference (eagerly; under ``torch.compile`` through the same ops,
    whose CPU implementation is the reference). Both trace with ``torch.compile(fullgraph=True,
    dynamic=True)``: under tracing the ops check ``cu_seqlens``' values where they run
    (``_validate.check_varlen_op``). Meta tensors go through the ops' fake implementations.
    """
    spec = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
        window=window, causal=causal, scale=scale,
    )
    check_flags(return_lse=return_lse, deterministic=deterministic)
    check_precision(precision)
    if q.is_cuda or torch.compiler.is_compiling() or q.device.type == "meta":
        # The ops flashsink::varlen_fwd/bwd: the kernels on CUDA; elsewhere the reference, read
        # cu_seqlens inside the op, where a traced graph does not see it; on meta tensors the fake.
        return kernel_attention_varlen(
            spec, q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, return_lse=return_lse, deterministic=deterministic,
            precision=precision,
        )
    return reference.attention_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, spec, return_lse=return_lse)


def attention_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    sinks=None,
    window=None,
    scale=None,
    layout="bhsd",
    return_lse=False,
    k_scale=None,
    v_scale=None,
):
    """Attention of new tokens against a (paged) KV cache: decode and chunked prefill for serving.

    FlashAttention's ``flash_attn_with_kvcache`` semantics, with sinks. Forward only: no autograd
    (NotImplementedError if an input requires grad while grad mode is on; serve under
    ``torch.inference_mode()``).

    Args:
        q: ``[B, H, S_q, D]`` (layout "bhsd") or ``[B, S_q, H, D]`` (layout "bshd"): the new tokens'
            queries (S_q = 1: decode; more: a prefill chunk).
        k_cache, v_cache: paged ``[num_pages, H_kv, page_size, D]`` ("bhsd") or ``[num_pages, page_size,
            H_kv, D]`` ("bshd", vLLM's) (``D_v`` for v) with ``block_table``, or contiguous ``[B, H_kv,
            S_max, D]`` / ``[B, S_max, H_kv, D]`` without. The new tokens' keys and values are already
            written to the cache.
        cache_seqlens: int32 ``[B]``: batch row b sees the first ``cache_seqlens[b]`` cached keys,
            its S_q queries being the last S_q of them (causal, bottom-right aligned).
        block_table: int32 ``[B, max_pages]``: key j of row b is row ``j % page_size`` of page
            ``block_table[b, j // page_size]``; entries past a row's last used page are ignored.
        sinks: ``[H]`` sink logits or None. window: keys ``[i-W+1, i]``. scale: default 1/sqrt(D).
        layout: ``"bhsd"`` (default, as :func:`attention`) or ``"bshd"``: the order of q, o and the caches.
            The CUDA kernels read "bshd" caches only (NotImplementedError for "bhsd" there: its cache would
            be copied whole on every call).
        return_lse: also return the natural-log LSE (sink included), float32 ``[B, H, S_q]``.
        k_scale, v_scale: for an fp8 cache only (``float8_e4m3fn`` k_cache and v_cache, q bf16 or fp16),
            and then required: float32 tensors on q's device, shape ``[1]`` (or ``[]``: one scale per
            tensor) or ``[H_kv]`` (one per KV head), as vLLM passes them; the cache holds
            ``float(k_cache) * k_scale``. Off CUDA their values must be finite and > 0 (ValueError); on
            CUDA a bad scale makes the heads it scales NaN (checked on the device, no host sync). On CUDA
            the fp8 cache is dequantized to q's dtype whole on every call until an fp8 kernel lands
            (correct, not yet faster).

    Returns o in q's layout (``D_v`` last) and dtype (and lse). Off CUDA this is
    :func:`flashsink.reference.attention_kvcache`, which checks the values of ``cache_seqlens`` and
    ``block_table`` on the host (ValueError); on CUDA the kernels check them on the device (no host
    sync) and write NaN to the rows of a batch row whose length, or a used page index, is out of range.

    Traces with ``torch.compile(fullgraph=True, dynamic=True)`` through the custom op
    ``flashsink::kvcache_fwd`` (the kernels on CUDA, this reference elsewhere, the values then checked
    inside the op); eager calls take the launches directly.
    """
    spec = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window=window, scale=scale,
                            return_lse=return_lse, layout=layout, k_scale=k_scale, v_scale=v_scale)
    if q.is_cuda and not torch.compiler.is_compiling():  # eagerly: the launches, no op dispatch
        return kernel_attention_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks,
                                        return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
    if torch.compiler.is_compiling() or q.device.type == "meta":
        # The op flashsink::kvcache_fwd: the kernels on CUDA; elsewhere the reference, which reads the
        # lengths and pages inside the op, where a traced graph does not see them; on meta tensors the fake.
        o, lse = torch.ops.flashsink.kvcache_fwd(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec.window,
                                                 spec.scale, spec.layout, k_scale, v_scale)
        return (o, lse) if return_lse else o
    return reference.attention_kvcache_validated(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec,
                                                 return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
