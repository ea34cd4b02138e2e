"""``flashsink.attention_kvcache`` on CUDA tensors: two launches and nothing else on the hot path.

The split-KV forward against the paged cache (``fwd_kvcache.py``) writes fp32 partials, and the
merge kernel (``merge_splits.py``) applies the sink and writes o and lse. Per call the host does
the metadata checks (``_validate_kvcache``), dict lookups for the configuration and the kernels,
three ``torch.empty`` and the two launches: no host sync, no value read, no torch op that a CUDA
graph would hide. A contiguous cache ``[B, S_max, H_kv, D]`` runs the same kernel as B pages of
S_max rows with the identity block table (cached per batch size and device).

Checked where: types, shapes, dtypes, devices and contiguity on the host, from metadata; the
values of ``cache_seqlens`` (``0 <= n <= max_pages * page_size``) and of the used block-table
entries (``0 <= page < num_pages``) in the kernel, which never reads out of bounds and writes NaN
instead (``fwd_kvcache.py`` says where). Nothing here imports tilelang.

An fp8 cache (float8_e4m3fn with float32 ``k_scale`` / ``v_scale``) has no kernel of its own yet (issue 53's
next step: a split-KV forward that reads fp8 K/V and scales them in registers, timed on a GPU before it is
routed): it is dequantized to q's dtype on the device, whole, and runs the fp16/bf16 kernels; correct, and
a read of the cache and a write of a copy twice its size on every call.
"""

import math

import torch

from ...reference import dequantize_kvcache
from ..compiler.registry import get_kernel
from ...kernel_config import KVCACHE_HEAD_DIMS, LOG2E, NO_WINDOW, SUPPORTED_DTYPES, KernelConfig, arch_of, split_tiles
from .dense import sm_count

_PLANS: dict = {}  # static facts -> (cfg, forward kernel, merge kernel, tiles)
_IDENTITY: dict = {}  # (batch, device) -> int32 [[0], [1], .., [B-1]]
_NO_SINKS: dict = {}  # (heads, device) -> an fp32 [H] the merge kernel does not read without sinks


def check_supported(spec, k_cache, v_cache) -> None:
    if spec.layout != "bshd":
        raise NotImplementedError(
            f"attention_kvcache kernels read the cache in layout 'bshd' on CUDA ([num_pages, page_size, H_kv, D] "
            f"or [B, S_max, H_kv, D], q [B, S_q, H, D]); got layout={spec.layout!r}. Keep the cache in that order "
            "and pass layout='bshd' (a 'bhsd' cache would be copied whole on every call)"
        )
    if spec.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"attention_kvcache kernels support float16 and bfloat16 on CUDA; got {spec.dtype}. "
            "Use flashsink.reference.attention_kvcache for other dtypes."
        )
    for name, d in (("q/k_cache", spec.head_dim), ("v_cache", spec.head_dim_v)):
        if d not in KVCACHE_HEAD_DIMS:
            raise NotImplementedError(
                f"attention_kvcache kernels support head dims {KVCACHE_HEAD_DIMS} on CUDA; the {name} head dim is {d}"
            )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise NotImplementedError(
                f"attention_kvcache kernels address {name} as a dense (contiguous) array on CUDA, got strides "
                f"{tuple(t.stride())} for shape {tuple(t.shape)}; allocate the cache contiguous once (a copy per "
                "call would cost a read and a write of the whole cache)"
            )


def _plan(spec, device):
    arch = arch_of(device)
    key = (arch, spec.dtype, spec.head_dim, spec.head_dim_v, spec.groups, spec.has_sinks)
    plan = _PLANS.get(key)
    if plan is None:
        cfg = KernelConfig(
            arch=arch, dtype=SUPPORTED_DTYPES[spec.dtype], head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
            groups=spec.groups, causal=True, has_sinks=spec.has_sinks, layout="bshd",
            deterministic=False, precision="strict",
        )
        plan = _PLANS[key] = (cfg, get_kernel("fwd_kvcache", cfg), get_kernel("merge_splits", cfg), split_tiles(cfg))
    return plan


def _identity(batch: int, device):
    key = (batch, device)
    t = _IDENTITY.get(key)
    if t is None:
        t = _IDENTITY[key] = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
    return t


def _no_sinks(heads: int, device):
    key = (heads, device)
    t = _NO_SINKS.get(key)
    if t is None:
        t = _NO_SINKS[key] = torch.zeros(heads, dtype=torch.float32, device=device)
    return t


#: programs per SM the split count aims for (``n_splits_for``): eight, four times the two that fit at once with
#: the kernel's prefetch registers (241 a thread), so that the programs of a long row's last round are short.
#: Measured on an H100 (lab/kvcache_variants.py, the kernel alone, decode-paged B=8): v23, 2 -> 4 per SM ran
#: 1.16-1.23x faster at 4k-64k keys; v24, 4 (9 splits) -> 8 (18): 16k 0.1565 -> 0.1424 ms, 64k 0.5810 -> 0.5243
#: (16 per SM, 36 splits: 0.1555 and 0.4965). At 4k the cap of four key tiles a split holds it at 8 splits.
PROGRAMS_PER_SM = 8


def n_splits_for(spec, tiles, sm_count: int) -> int:
    """Splits of each row's keys: enough programs for about ``PROGRAMS_PER_SM`` per SM, at least four key
    tiles each, sized by the capacity (the lengths stay on the device); a shorter row's splits just get
    fewer tiles, and a split with none writes lse = -inf, which the merge ignores."""
    m_tiles = -(-spec.groups * spec.seq_q // tiles.block_m)
    programs = m_tiles * spec.batch * spec.kv_heads
    blocks = -(-spec.capacity // tiles.block_n)
    return max(1, min(math.ceil(PROGRAMS_PER_SM * sm_count / programs), blocks // 4))


def _nan_unless_positive(scale):
    """``scale`` with NaN where it is not finite and > 0: checked on the device (no host sync), so a bad
    scale gives NaN in the heads it scales, as a bad length does in its batch row, never a wrong number."""
    return torch.where(torch.isfinite(scale) & (scale > 0), scale, float("nan"))


def kernel_attention_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, *, return_lse,
                             k_scale=None, v_scale=None):
    """Run validated inputs through the kernels (forward only)."""
    check_supported(spec, k_cache, v_cache)
    dev = q.device
    B, Sq, H, Dv = spec.batch, spec.seq_q, spec.heads, spec.head_dim_v
    o = torch.empty((B, Sq, H, Dv), dtype=q.dtype, device=dev)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=dev)
    if B == 0 or Sq == 0:
        return (o, lse) if return_lse else o
    if spec.fp8:  # no fp8 kernel yet (module docstring): the fp16/bf16 kernels on a dequantized copy
        k_cache = dequantize_kvcache(k_cache, _nan_unless_positive(k_scale), q.dtype)
        v_cache = dequantize_kvcache(v_cache, _nan_unless_positive(v_scale), q.dtype)
    cfg, fwd, merge, tiles = _plan(spec, dev)
    if block_table is None:
        block_table = _identity(B, dev)
    q = q if q.is_contiguous() else q.contiguous()
    block_table = block_table if block_table.is_contiguous() else block_table.contiguous()
    lengths = cache_seqlens if cache_seqlens.is_contiguous() else cache_seqlens.contiguous()
    if sinks is None:
        sinks32 = _no_sinks(H, dev)
    else:
        sinks32 = sinks if sinks.dtype == torch.float32 and sinks.is_contiguous() else sinks.to(torch.float32).contiguous()
    S = n_splits_for(spec, tiles, sm_count(dev))
    # two allocations: on the GPU host a slice or a view costs as much as an allocation (perf-log.md v8)
    o_part = torch.empty((B, H, Sq, S, Dv), dtype=torch.float32, device=dev)
    lse_part = torch.empty((B, H, Sq, S), dtype=torch.float32, device=dev)
    window = NO_WINDOW if spec.window is None else min(spec.window, NO_WINDOW)
    fwd(q, k_cache, v_cache, block_table, lengths, window, spec.scale * LOG2E, o_part, lse_part)
    merge(o_part, lse_part, sinks32, o, lse)
    return (o, lse) if return_lse else o
