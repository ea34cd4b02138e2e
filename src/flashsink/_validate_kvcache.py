"""Argument validation of ``attention_kvcache`` (decode and chunked prefill against a KV cache).

Two kinds of checks:

- :func:`validate_kvcache`: types, shapes, dtypes and devices, read from the tensors' metadata
  only (no host sync), on every device;
- :func:`check_cache_values`: the *values* of ``cache_seqlens``, of the block-table entries a
  sequence uses and of an fp8 cache's ``k_scale`` / ``v_scale``, read on the host. The reference (every
  device but CUDA) runs it; on CUDA the same conditions are checked on the device instead
  (``ops/launch/kvcache.py``), so a serving step never waits for the host.

An fp8 cache (``float8_e4m3fn`` K and V) holds ``float(k_cache) * k_scale``: float32 scales of shape
``[]`` / ``[1]`` (one per tensor, vLLM's default) or ``[H_kv]`` (one per KV head, vLLM's per-head
calibration), finite and > 0; queries bf16 or fp16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._validate import (LAYOUTS, check_choice, check_flags, check_heads, check_options, check_same_dtype_device,
                        check_sinks, check_strided, check_tensor, shape_text, spec_window)


#: the fp8 cache format (OCP E4M3, vLLM's and FlashInfer's "fp8"), and the query dtypes that go with it
FP8_CACHE_DTYPE = torch.float8_e4m3fn
FP8_QUERY_DTYPES = (torch.bfloat16, torch.float16)
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                "float8_e8m0fnu") if hasattr(torch, n))


@dataclass(frozen=True)
class KVCacheSpec:
    """Static description of one ``attention_kvcache`` problem.

    A contiguous cache ``[B, S_max, H_kv, D]`` (layout "bshd") is described as a paged one with ``B`` pages of
    ``S_max`` rows and one page per sequence (``paged=False``, ``max_pages=1``): batch row b's
    page is page b.
    """

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    head_dim: int
    head_dim_v: int
    window: int | None
    scale: float
    dtype: torch.dtype
    has_sinks: bool
    paged: bool
    num_pages: int
    page_size: int
    max_pages: int
    layout: str  # of q, o and the caches (``_validate.LAYOUTS``); the kernels read "bshd"
    cache_dtype: torch.dtype  # q's, or FP8_CACHE_DTYPE (then k_scale / v_scale dequantize it)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == FP8_CACHE_DTYPE

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def capacity(self) -> int:
        """Most keys one sequence can hold (``cache_seqlens`` must not exceed it)."""
        return self.max_pages * self.page_size


def _check_int_tensor(name: str, t, dims: int, what: str, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 {what}, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32 (the kernels read it on the device), got {t.dtype}; "
                        f"convert it once with .to(torch.int32)")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {what}, got {t.dim()}-D shape {shape_text(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}")


def refuse_grad(q, k_cache, v_cache, sinks, k_scale=None, v_scale=None) -> None:
    """NotImplementedError naming the first input that requires grad (the caller knows grad mode is on)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("sinks", sinks), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if t is not None and t.requires_grad:
            raise NotImplementedError(
                f"attention_kvcache is forward only (serving: decode and chunked prefill) and tracks no "
                f"gradients, but {name} requires grad; call it under torch.no_grad() or "
                f"torch.inference_mode() (or pass {name}.detach()), or use flashsink.attention for training"
            )


def _check_dtypes(q, k_cache, v_cache) -> bool:
    """q's and the caches' dtypes and devices; True for an fp8 cache."""
    if q.dtype in _FP8_DTYPES:
        raise NotImplementedError(
            f"q has dtype {q.dtype}: fp8 queries are not supported; pass q in bfloat16 or float16 "
            f"(the caches may be {FP8_CACHE_DTYPE}, with k_scale and v_scale)"
        )
    check_tensor("q", q)
    if k_cache.dtype not in _FP8_DTYPES and v_cache.dtype not in _FP8_DTYPES:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, t)
        try:
            check_same_dtype_device(q, k_cache, v_cache)
        except ValueError as exc:
            raise ValueError(str(exc).replace("q, k and v", "q, k_cache and v_cache")) from None
        return False
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must share one dtype, got k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; "
            f"an fp8 cache stores both in {FP8_CACHE_DTYPE} (with k_scale and v_scale)"
        )
    if k_cache.dtype != FP8_CACHE_DTYPE:
        raise NotImplementedError(
            f"k_cache and v_cache have dtype {k_cache.dtype}; the fp8 caches supported are {FP8_CACHE_DTYPE} "
            f"(with float32 k_scale / v_scale), or q's dtype"
        )
    if q.dtype not in FP8_QUERY_DTYPES:
        raise NotImplementedError(
            f"with a {FP8_CACHE_DTYPE} cache q must be bfloat16 or float16, got {q.dtype}"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache and v_cache must be on one device, got q {q.device}, k_cache {k_cache.device}, "
                         f"v_cache {v_cache.device}")
    return True


def _check_scales(fp8: bool, k_scale, v_scale, k_cache, kv_heads: int, device) -> None:
    """The scales' metadata: given exactly with an fp8 cache, float32 ``[]`` / ``[1]`` / ``[H_kv]`` on q's device."""
    need = (f"a float32 tensor of shape [1] (one scale for the tensor) or [H_kv] = [{kv_heads}] (one per KV head) "
            f"on q's device ({device})")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if t is not None:
                raise ValueError(
                    f"{name} is given but the cache has dtype {k_cache.dtype}: scales dequantize a {FP8_CACHE_DTYPE} "
                    f"cache; pass {name}=None, or store the cache in {FP8_CACHE_DTYPE}"
                )
            continue
        if t is None:
            raise ValueError(
                f"{name} is required with a {FP8_CACHE_DTYPE} cache (it holds float(cache) * {name}): pass {need}; "
                f"torch.ones(1, device=q.device) for an unscaled cache"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be {need}, got {type(t).__name__} ({t!r}); wrap a number as "
                            f"torch.tensor([{name}], device=q.device)")
        check_strided(name, t)
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype float32, got {t.dtype}; convert it once with .float()")
        if tuple(t.shape) not in ((), (1,), (kv_heads,)):
            raise ValueError(f"{name} must be {need}, got shape {shape_text(t)}")
        if t.device != device:
            raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}; "
                             f"move it once with .to(q.device)")


def _cache_layouts(layout: str, paged: bool) -> tuple[str, str]:
    """The shapes of q and of the caches in ``layout``, for the messages."""
    if layout == "bhsd":
        return "[B, H, S_q, D]", "[num_pages, H_kv, page_size, D]" if paged else "[B, H_kv, S_max, D]"
    return "[B, S_q, H, D]", "[num_pages, page_size, H_kv, D]" if paged else "[B, S_max, H_kv, D]"


def validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, sinks, *, window, scale, return_lse,
                     layout, k_scale=None, v_scale=None) -> KVCacheSpec:
    """Check the arguments of ``attention_kvcache`` from metadata alone; return the :class:`KVCacheSpec`.

    ``layout`` orders the sequence and head axes of q, o and the caches, as ``attention``'s does of q, k
    and v. "bshd": q ``[B, S_q, H, D]``; with ``block_table`` (int32 ``[B, max_pages]``) the caches are
    ``[num_pages, page_size, H_kv, D]`` / ``[.., D_v]``, else ``[B, S_max, H_kv, D]``. "bhsd": q
    ``[B, H, S_q, D]``, caches ``[num_pages, H_kv, page_size, D]`` or ``[B, H_kv, S_max, D]``.
    ``cache_seqlens`` int32 ``[B]``. A ``float8_e4m3fn`` cache needs ``k_scale`` and ``v_scale`` (module
    docstring); any other cache refuses them.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, floating=False)
    if sinks is not None:
        check_tensor("sinks", sinks)
    check_options(window, True, scale)
    check_flags(return_lse=return_lse)
    check_choice("layout", layout, LAYOUTS)
    paged = block_table is not None
    q_what, what = _cache_layouts(layout, paged)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D {q_what} for layout={layout!r}, got {q.dim()}-D shape {shape_text(q)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {what} for layout={layout!r} "
                f"({'paged: block_table given' if paged else 'no block_table'}), got {t.dim()}-D shape {shape_text(t)}"
            )
    fp8 = _check_dtypes(q, k_cache, v_cache)
    if layout == "bhsd":
        b, h, sq, d = q.shape
        n0, hk, rows, dk = k_cache.shape
        v_lead = (v_cache.shape[0], v_cache.shape[2], v_cache.shape[1])
    else:
        b, sq, h, d = q.shape
        n0, rows, hk, dk = k_cache.shape
        v_lead = tuple(v_cache.shape[:3])
    if v_lead != (n0, rows, hk):
        raise ValueError(f"v_cache must match k_cache in its first three dims {what} (layout={layout!r}): "
                         f"k_cache {shape_text(k_cache)}, v_cache {shape_text(v_cache)}")
    if dk != d:
        raise ValueError(f"k_cache head_dim ({dk}) must equal q head_dim ({d}); q {shape_text(q)}, k_cache {shape_text(k_cache)}")
    check_heads(h, hk, d, v_cache.shape[3], lambda: f"layout={layout!r}, q {shape_text(q)}, k_cache {shape_text(k_cache)}")
    check_sinks(sinks, h, q.device)
    _check_scales(fp8, k_scale, v_scale, k_cache, hk, q.device)
    _check_int_tensor("cache_seqlens", cache_seqlens, 1, "[B] (keys in the cache per batch row)", q.device)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens must have one entry per batch row of q ([{b}]), got shape {shape_text(cache_seqlens)}")
    if paged:
        _check_int_tensor("block_table", block_table, 2, "[B, max_pages] (page indices per batch row)", q.device)
        if block_table.shape[0] != b or block_table.shape[1] < 1:
            raise ValueError(f"block_table must be [B, max_pages] = [{b}, >= 1], got shape {shape_text(block_table)}")
        if rows < 1:
            raise ValueError(f"page_size must be >= 1, got k_cache {shape_text(k_cache)} {what} (layout={layout!r})")
        num_pages, page_size, max_pages = n0, rows, block_table.shape[1]
    else:
        if n0 != b:
            raise ValueError(f"k_cache batch ({n0}) must equal q batch ({b}) for a contiguous cache "
                             f"{what} (pass block_table for a paged one); k_cache {shape_text(k_cache)}")
        num_pages, page_size, max_pages = b, rows, 1
    if torch.is_grad_enabled():
        refuse_grad(q, k_cache, v_cache, sinks, k_scale, v_scale)
    return KVCacheSpec(
        batch=b, heads=h, kv_heads=hk, seq_q=sq, head_dim=d, head_dim_v=v_cache.shape[3],
        window=spec_window(window),  # clamped: the op's int64 window, the masks' integer arithmetic
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        dtype=q.dtype, has_sinks=sinks is not None, paged=paged,
        num_pages=num_pages, page_size=page_size, max_pages=max_pages, layout=layout,
        cache_dtype=k_cache.dtype,
    )


def check_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, scale, layout, k_scale=None,
                     v_scale=None) -> KVCacheSpec:
    """``flashsink::kvcache_fwd``: the checks of :func:`validate_kvcache` (the op's schema requires a
    float ``scale`` and the ``layout``; it always returns lse). Off CUDA the op's implementation checks the
    values too."""
    return validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window=window, scale=scale,
                            return_lse=True, layout=layout, k_scale=k_scale, v_scale=v_scale)


def to_bshd(spec: KVCacheSpec, q, k_cache, v_cache):
    """q and the caches as "bshd" views (no copy): the order the reference and the kernels read."""
    if spec.layout == "bshd":
        return q, k_cache, v_cache
    return q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)


def from_bshd(spec: KVCacheSpec, o):
    """o ``[B, S_q, H, D_v]`` in the call's layout."""
    return o if spec.layout == "bshd" else o.transpose(1, 2)


def check_cache_values(spec: KVCacheSpec, cache_seqlens, block_table, k_scale=None,
                       v_scale=None) -> tuple[list[int], list[list[int]] | None]:
    """The values, read on the host (one copy each): ``0 <= cache_seqlens[b] <= capacity``, the
    block-table entries of the pages a sequence uses (the first ``ceil(cache_seqlens[b] /
    page_size)``) in ``[0, num_pages)`` (entries past them are padding and may hold anything), and an
    fp8 cache's scales finite and > 0. Returns the lengths and the used pages per row (None for a
    contiguous cache)."""
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None:
            for i, x in enumerate(t.detach().cpu().reshape(-1).tolist()):
                if not (math.isfinite(x) and x > 0):
                    where = "" if t.dim() == 0 else f"[{i}]"
                    raise ValueError(f"{name}{where} = {x} must be finite and > 0 (the cache holds float(cache) * "
                                     f"{name}); a zero, negative or non-finite scale is a calibration error")
    lengths = cache_seqlens.detach().cpu().tolist()
    for i, n in enumerate(lengths):
        if not 0 <= n <= spec.capacity:
            where = (f"max_pages * page_size = {spec.max_pages} * {spec.page_size}" if spec.paged
                     else f"S_max = k_cache.shape[1]")
            raise ValueError(f"cache_seqlens[{i}] = {n} must be in [0, {spec.capacity}] ({where})")
    if block_table is None:
        return lengths, None
    table = block_table.detach().cpu().tolist()
    pages = []
    for i, n in enumerate(lengths):
        used = table[i][: -(-n // spec.page_size)]
        for j, p in enumerate(used):
            if not 0 <= p < spec.num_pages:
                raise ValueError(
                    f"block_table[{i}, {j}] = {p} must be a page index in [0, {spec.num_pages}) "
                    f"(k_cache.shape[0]): batch row {i} holds {n} keys, so it uses its first {len(used)} pages"
                )
        pages.append(used)
    return lengths, pages
