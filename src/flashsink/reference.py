"""Pure-PyTorch reference for attention with learnable sinks.

It is the ground truth the kernels are judged against (and is itself proven against an
independent eager formula in ``tests/test_reference.py``). It runs on any device, and its
backward is plain autograd, for q, k, v and sinks.

Math, per query head h and query row at absolute position i::

    s_j  = scale * q . k_j                      for visible keys j
    p_j  = exp(s_j) / (sum_j exp(s_j) + exp(sink_h))
    o    = sum_j p_j v_j                        (the sink has no value)
    lse  = log(sum_j exp(s_j) + exp(sink_h))    (natural log, includes the sink)

Visibility (``flashsink.visibility``): causal keys j <= i; with a window W, keys [i-W+1, i]. Query
row r has absolute position r + (seq_kv - seq_q) (bottom-right alignment). A row that sees no key gives o = 0 and
lse = sink_h (or -inf without sinks), with finite (zero) gradients.

Non-finite inputs follow the formula: a masked key contributes nothing, whatever its k and v hold.
Scores are IEEE products (a NaN/Inf in q or a visible k gives NaN or +-Inf scores; a -Inf score is
an invisible key); a NaN/Inf in column d of a visible key's v makes o[..., d] of that query NaN.
Rows that see no non-finite entry are exact, as if it were not there. Gradients: with a non-finite
v, those of unaffected rows and of the keys only they see are exact; with a non-finite q or k
(scores: autograd multiplies the masked zeros into k and q), unspecified.
"""

from __future__ import annotations

import torch

from ._validate import AttnSpec, check_flags, validate_attention, validate_varlen
from ._validate_kvcache import KVCacheSpec, check_cache_values, from_bshd, to_bshd, validate_kvcache
from .visibility import last_key, position, window_edge

__all__ = ["attention", "attention_kvcache", "attention_varlen", "dequantize_kvcache", "gather_kvcache", "visible_mask"]


def visible_mask(seq_q: int, seq_kv: int, *, window: int | None, causal: bool, device=None) -> torch.Tensor:
    """Bool ``[seq_q, seq_kv]``: True where query row r may see key j (bottom-right aligned)."""
    pos = position(torch.arange(seq_q, device=device).unsqueeze(1), seq_q, seq_kv)  # [seq_q, 1]
    keys = torch.arange(seq_kv, device=device).unsqueeze(0)
    visible = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=device)
    if causal:
        visible = visible & (keys <= last_key(pos))
    if window is not None:
        visible = visible & (keys > window_edge(pos, window))
    return visible


def finite_part(x: torch.Tensor):
    """``x`` with its non-finite entries zeroed, and where they were. The matmuls only ever see the
    finite part, so a masked key's NaN never meets a zero probability (0 * NaN = NaN): by the formula a
    masked key contributes nothing. The non-finite entries come back as NaN, by selection, where a
    visible pair uses them."""
    bad = ~torch.isfinite(x)
    return torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x), bad


def seen_bad(bad: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, Hk, Sq, D]``: True where query row r sees (``visible [Sq, Skv]``) a key whose
    column d is non-finite (``bad [B, Hk, Skv, D]``). Counts of 0/1, exact in the matmul."""
    return torch.matmul(visible.to(torch.float32), bad.to(torch.float32)) > 0


def resolve_compute_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise TypeError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_bhsd(q, k, v, sinks, spec: AttnSpec, cdt: torch.dtype):
    """Core on ``[B, H, S, D]`` views. Returns o ``[B, H, S_q, D_v]`` (compute dtype) and lse ``[B, H, S_q]``."""
    b, hk, g = spec.batch, spec.kv_heads, spec.groups
    sq, skv = spec.seq_q, spec.seq_kv
    visible = visible_mask(sq, skv, window=spec.window, causal=spec.causal, device=q.device)
    qc, kc = q.to(cdt), k.to(cdt)
    vc, v_bad = finite_part(v.to(cdt))

    # GQA without copying K/V: query head h uses kv head h // g, so fold the g query heads of
    # one kv head into the row dimension of a batched matmul.
    q5 = qc.reshape(b, hk, g * sq, spec.head_dim)
    s = torch.matmul(q5, kc.transpose(-1, -2)).view(b, hk, g, sq, skv) * spec.scale  # [B, Hk, G, Sq, Skv]
    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=q.device)
    s = torch.where(visible, s, neg_inf)  # backward of where only routes grad, never multiplies by inf

    if skv > 0:
        m = s.amax(dim=-1)  # [B, Hk, G, Sq]
    else:
        m = torch.full((b, hk, g, sq), float("-inf"), dtype=cdt, device=q.device)
    if sinks is not None:
        sink = sinks.to(cdt).view(1, hk, g, 1)
        m = torch.maximum(m, sink)
    # m only stabilises exp; the result does not depend on it, so no gradient flows through it.
    m = m.detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=cdt, device=q.device))

    e = torch.exp(s - m.unsqueeze(-1))  # masked entries: exp(-inf) = 0, gradient 0
    denom = e.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    empty = denom <= 0  # only possible without sinks: a row that sees no key
    one = torch.ones((), dtype=cdt, device=q.device)
    denom_safe = torch.where(empty, one, denom)

    p = e / denom_safe.unsqueeze(-1)
    o = torch.matmul(p.view(b, hk, g * sq, skv), vc).view(b, hk, g, sq, spec.head_dim_v)
    o = torch.where(seen_bad(v_bad, visible).unsqueeze(2), float("nan"), o).view(b, spec.heads, sq, spec.head_dim_v)
    lse = torch.where(empty, neg_inf, m + torch.log(denom_safe)).view(b, spec.heads, sq)
    return o, lse


def _lse_dtype(cdt: torch.dtype) -> torch.dtype:
    return torch.float64 if cdt == torch.float64 else torch.float32


def attention_validated(q, k, v, sinks, spec: AttnSpec, *, return_lse: bool, compute_dtype=None):
    """Reference on an already validated problem (``spec`` from ``validate_attention``)."""
    cdt = resolve_compute_dtype(q.dtype, compute_dtype)
    if spec.layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    o, lse = attention_bhsd(q, k, v, sinks, spec, cdt)
    o = o.to(q.dtype)
    if spec.layout == "bshd":
        o = o.transpose(1, 2)
    if return_lse:
        return o, lse.to(_lse_dtype(cdt))
    return o


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
    compute_dtype=None,
):
    """Attention with learnable sinks, in plain PyTorch.

    Args:
        q: ``[B, H, S_q, D]`` (layout "bhsd") or ``[B, S_q, H, D]`` (layout "bshd").
        k, v: ``[B, H_kv, S_kv, D]`` / ``[B, H_kv, S_kv, D_v]`` (or the "bshd" order); ``H % H_kv == 0``.
        sinks: ``[H]`` sink logits, any float dtype, or None for plain softmax attention.
        window: keys ``[i-W+1, i]`` visible to the query at position i (needs ``causal=True``).
        causal: causal mask, bottom-right aligned when ``S_q != S_kv``.
        scale: score scale, default ``1/sqrt(D)``.
        return_lse: also return the natural-log LSE (sink included), ``[B, H, S_q]`` in both layouts.
        compute_dtype: dtype of the computation; default float32 (float64 for float64 inputs).

    Returns:
        o in q's dtype and layout, and, with ``return_lse``, lse in float32 (float64 when computing
        in float64).
    """
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    check_flags(return_lse=return_lse)
    return attention_validated(q, k, v, sinks, spec, return_lse=return_lse, compute_dtype=compute_dtype)


def attention_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, spec: AttnSpec, *, return_lse,
                               compute_dtype=None):
    """Varlen reference on a validated problem: one dense reference call per sequence."""
    cdt = resolve_compute_dtype(q.dtype, compute_dtype)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(spec.batch):
        qi = q[cu_q[i]:cu_q[i + 1]].unsqueeze(0)  # [1, Sq_i, H, D]
        ki = k[cu_k[i]:cu_k[i + 1]].unsqueeze(0)
        vi = v[cu_k[i]:cu_k[i + 1]].unsqueeze(0)
        o, lse = attention_validated(qi, ki, vi, sinks, spec.one_sequence(qi.shape[1], ki.shape[1]), return_lse=True,
                            compute_dtype=cdt)
        outs.append(o[0])  # [Sq_i, H, Dv]
        lses.append(lse[0])  # [H, Sq_i]
    if outs:
        o = torch.cat(outs, dim=0)
        lse = torch.cat(lses, dim=1)
    else:  # no sequences at all (cu_seqlens = [0]); total tokens is then 0
        o = q.new_zeros(0, spec.heads, spec.head_dim_v)
        lse = torch.zeros(spec.heads, 0, dtype=_lse_dtype(cdt), device=q.device)
    return (o, lse) if return_lse else o


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
    compute_dtype=None,
):
    """Varlen (THD) attention with sinks in plain PyTorch.

    q ``[total_q, H, D]``, k ``[total_k, H_kv, D]``, v ``[total_k, H_kv, D_v]``; sequence i is rows
    ``cu_seqlens[i]:cu_seqlens[i+1]``, and causal / window masks apply within each sequence,
    bottom-right aligned per sequence. Returns o ``[total_q, H, D_v]`` and, with ``return_lse``,
    lse ``[H, total_q]`` (float32, or float64 when computing in float64).
    """
    spec = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
        window=window, causal=causal, scale=scale,
    )
    check_flags(return_lse=return_lse)
    return attention_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, spec, return_lse=return_lse,
                                      compute_dtype=compute_dtype)


def gather_kvcache(cache: torch.Tensor, length: int, pages: list[int] | None = None, row: int = 0) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence, contiguous ``[length, H_kv, D]``: from its
    ``pages`` of a paged cache ``[num_pages, page_size, H_kv, D]``, or from batch ``row`` of a
    contiguous one ``[B, S_max, H_kv, D]`` (``pages=None``)."""
    if pages is None:
        return cache[row, :length]
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    return cache[index].flatten(0, 1)[:length]


def dequantize_kvcache(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float(cache) * scale`` in ``dtype``, contiguous: ``cache [..., H_kv, D]`` in float8_e4m3fn, ``scale``
    float32 ``[]`` / ``[1]`` (per tensor) or ``[H_kv]`` (per KV head). Every e4m3 value is exact in fp16,
    bf16 and wider, so the cast is exact; the product is computed in float32 (``dtype`` if wider) and
    written in ``dtype``, with no intermediate copy in float32."""
    wide = cache.to(dtype)
    return torch.mul(wide, scale.reshape(-1, 1), out=torch.empty(wide.shape, dtype=dtype, device=wide.device))


def attention_kvcache_validated(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec: KVCacheSpec, *,
                                return_lse, compute_dtype=None, k_scale=None, v_scale=None):
    """KV-cache reference on a validated problem: the values of the lengths, pages and scales checked
    (ValueError), each sequence's keys gathered (dequantized in the compute dtype for an fp8 cache),
    then the dense reference (causal, bottom-right aligned: the S_q queries are the last S_q of the
    sequence). Works in "bshd" (views of q and the caches in the call's layout); o comes back in that layout."""
    lengths, pages = check_cache_values(spec, cache_seqlens, block_table, k_scale, v_scale)
    cdt = resolve_compute_dtype(q.dtype, compute_dtype)
    q, k_cache, v_cache = to_bshd(spec, q, k_cache, v_cache)
    outs, lses = [], []
    for b, n in enumerate(lengths):
        k = gather_kvcache(k_cache, n, None if pages is None else pages[b], b).unsqueeze(0)
        v = gather_kvcache(v_cache, n, None if pages is None else pages[b], b).unsqueeze(0)
        if spec.fp8:  # the rows a sequence uses only, not the whole cache
            k, v = dequantize_kvcache(k, k_scale, cdt), dequantize_kvcache(v, v_scale, cdt)
        sub = AttnSpec(1, spec.heads, spec.kv_heads, spec.seq_q, n, spec.head_dim, spec.head_dim_v,
                       window=spec.window, causal=True, scale=spec.scale, layout="bshd", dtype=spec.dtype,
                       has_sinks=spec.has_sinks)
        o, lse = attention_validated(q[b : b + 1], k, v, sinks, sub, return_lse=True, compute_dtype=cdt)
        outs.append(o)
        lses.append(lse)
    if outs:
        o, lse = torch.cat(outs), torch.cat(lses)
    else:  # an empty batch
        o = q.new_zeros(0, spec.seq_q, spec.heads, spec.head_dim_v)
        lse = torch.zeros(0, spec.heads, spec.seq_q, dtype=_lse_dtype(cdt), device=q.device)
    o = from_bshd(spec, o).contiguous()
    return (o, lse) if return_lse else o


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
    compute_dtype=None,
    k_scale=None,
    v_scale=None,
):
    """Attention against a (paged) KV cache in plain PyTorch: ``flashsink.attention_kvcache``'s
    reference (forward only, like it). Batch row b's ``S_q`` queries are the last ``S_q`` tokens
    of a sequence whose first ``cache_seqlens[b]`` keys are in the cache (causal, bottom-right
    aligned). ``layout`` as :func:`attention`'s, for q, o and the caches. "bhsd": q ``[B, H, S_q, D]``,
    paged caches ``[num_pages, H_kv, page_size, D]`` with ``block_table`` int32 ``[B, max_pages]``,
    contiguous ones ``[B, H_kv, S_max, D]``; "bshd": q ``[B, S_q, H, D]``, caches ``[num_pages,
    page_size, H_kv, D]`` / ``[B, S_max, H_kv, D]``. The values of ``cache_seqlens`` and of the used
    block-table entries are checked here (ValueError). An fp8 cache (``float8_e4m3fn``, q bf16 or fp16)
    holds ``float(cache) * scale`` with float32 ``k_scale`` / ``v_scale`` of shape ``[]`` / ``[1]`` or
    ``[H_kv]``: each sequence's rows are dequantized in the compute dtype, then as above. Returns o in
    q's layout and dtype (``D_v`` last) and, with ``return_lse``, lse ``[B, H, S_q]`` (float32, or float64
    when computing in float64)."""
    spec = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window=window, scale=scale,
                            return_lse=return_lse, layout=layout, k_scale=k_scale, v_scale=v_scale)
    return attention_kvcache_validated(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec,
                                       return_lse=return_lse, compute_dtype=compute_dtype, k_scale=k_scale,
                                       v_scale=v_scale)
