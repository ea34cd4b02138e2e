"""The launch API: the kernels' configuration, buffers and launches, for every caller.

A validated problem (an ``AttnSpec``) runs in two steps, for the padded layouts and (with
``cu_seqlens``) packed varlen batches (layout ``thd``) alike:

    plan, q, k, v, sinks32 = prepare(spec, q, k, v, sinks, deterministic=..., precision=..., cu_seqlens=...)
    o, lse = forward(plan, q, k, v, sinks32)
    dq, dk, dv, dsink = backward(plan, do, q, k, v, o, lse, dlse, sinks32)

``prepare`` is where the kernels' own conditions are met (:func:`check_supported`, the head dims
zero-padded to the kernels', the sinks in float32, :func:`kernel_config`); :class:`Plan` carries
what ``forward`` and ``backward`` need beyond tensors. Two callers, neither imported here: the eager
``torch.autograd.Function`` of ``attention.py`` (what ``flashsink.attention`` runs on CUDA outside
``torch.compile``) and the custom ops of ``custom_ops.py`` (the same launches, traceable). Validation
happened once, in the public function (``flashsink.api``) or the op. Nothing here imports tilelang:
kernels are built on first launch (``registry.get_kernel``).

Host time matters here (every eager call runs this): the kernel handle is one dict lookup, the
buffers that must start zeroed share one fill (the dQ accumulator none: the preprocess zeroes it),
and nothing is filled that no kernel reads.
"""

import functools
from typing import NamedTuple, Optional

import torch

from . import decode
from ..compiler.registry import get_kernel
from ..compiler.kinds import KINDS, forward_kind
from ...kernel_config import (
    BWD_SPLIT_MIN_ROWS, HEAD_DIM_RULE, LOG2E, NO_WINDOW, PRECISIONS, ROW_PAD, SUPPORTED_DTYPES,
    KernelConfig, arch_of, bwd_split, fwd_o32, kernel_head_dim,
)
from ...kernel_config import padded_rows, varlen_rows

__all__ = [
    "Plan", "prepare", "forward", "backward", "sinks_f32", "pad_head_dims", "check_supported", "kernel_config",
    "kernel_window", "sm_count",
]


def kernel_window(window) -> int:
    """The kernels' runtime window: NO_WINDOW (wider than any sequence) for none."""
    return NO_WINDOW if window is None else min(int(window), NO_WINDOW)


def _kernel_dim(d: int) -> int:
    """Head dim the kernels run with (:func:`config.kernel_head_dim`): zero-padding is exact (zero
    columns add nothing to q.k, and the padded columns of o, dq, dk, dv are dropped)."""
    native = kernel_head_dim(d)
    if native is None:
        raise AssertionError(d)  # unreachable after check_supported
    return native


def check_supported(spec) -> None:
    """NotImplementedError unless the kernels take this (validated) problem's dtype and head dims."""
    if spec.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"flashsink kernels support float16 and bfloat16 inputs on CUDA; got {spec.dtype}. "
            "Cast q, k, v to one of those, or use flashsink.reference.attention for other dtypes."
        )
    if kernel_head_dim(spec.head_dim) is not None and kernel_head_dim(spec.head_dim_v) is not None:
        return  # every call: no more work than the two rule checks
    for name, d in (("head_dim of q and k", spec.head_dim), ("head_dim of v", spec.head_dim_v)):
        if kernel_head_dim(d) is None:
            raise NotImplementedError(
                f"flashsink kernels support head dims that are {HEAD_DIM_RULE} "
                f"(64 and 128 are the fast ones); the {name} is {d}."
            )


#: kernel_config's results by the facts they depend on: built and checked once per configuration
_CONFIGS: dict = {}


def kernel_config(spec, device, deterministic: bool, precision: str = "fast") -> KernelConfig:
    """The static configuration for a validated problem, or NotImplementedError. ``precision`` is not
    checked here: the public functions (``_validate.check_precision``) and the ops
    (``_validate.check_op_options``) checked it, each once; an unknown one is an AssertionError."""
    key = (arch_of(device), spec.kernel_key, bool(deterministic), precision)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        check_supported(spec)
        assert precision in PRECISIONS, precision
        cfg = _CONFIGS[key] = _config_of(*key)
    return cfg


def _config_of(arch, kernel_key, deterministic, precision) -> KernelConfig:
    """The KernelConfig of kernel_config's key: each field from the spec's ``kernel_key``."""
    dtype, head_dim, head_dim_v, groups, causal, has_sinks, layout = kernel_key
    return KernelConfig(
        arch=arch, dtype=SUPPORTED_DTYPES[dtype], head_dim=_kernel_dim(head_dim), head_dim_v=_kernel_dim(head_dim_v),
        groups=groups, causal=causal, has_sinks=has_sinks, layout=layout, deterministic=deterministic,
        precision=precision,
    )


class Plan(NamedTuple):
    """What :func:`forward` and :func:`backward` need beyond tensors (:func:`prepare` makes it):
    the validated problem, the kernels' configuration, their runtime window (:func:`kernel_window`)
    and, for a packed batch (layout ``thd``), ``(cu_q, cu_k)``: int32 on q's device (else None)."""

    spec: object  # the AttnSpec (_validate)
    cfg: KernelConfig
    window: int
    cu_seqlens: Optional[tuple] = None


def prepare(spec, q, k, v, sinks, *, deterministic=False, precision="fast", cu_seqlens=None, pad=True):
    """The launch plan of a validated problem, and q, k, v and the sinks as the kernels take them:
    ``(plan, q, k, v, sinks32)``.

    NotImplementedError unless the kernels take the problem (:func:`check_supported`, once per
    configuration: :func:`kernel_config` keeps them). ``pad``: q, k, v contiguous with their head
    dims zero-padded to the kernels' (exact: zero columns add nothing to q.k; autograd slices the
    gradients back); without it contiguous only (the ops, which take native head dims).
    ``sinks32``: :func:`sinks_f32` (what the kernels read; float32 sinks are passed as they are, and
    their gradient stays the caller's: the autograd function's or the ops' formula)."""
    cfg = kernel_config(spec, q.device, deterministic, precision)
    if pad:
        q, k, v = _pad_dim(q, cfg.head_dim), _pad_dim(k, cfg.head_dim), _pad_dim(v, cfg.head_dim_v)
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return Plan(spec, cfg, kernel_window(spec.window), cu_seqlens), q, k, v, sinks_f32(sinks, spec.heads, q.device)


def pad_head_dims(spec, q, k, v):
    """q, k, v contiguous, head dims zero-padded to the kernels' (:func:`prepare`'s padding, for the
    traced route, whose ops make their own plan), for a problem :func:`check_supported` passed."""
    d, dv = _kernel_dim(spec.head_dim), _kernel_dim(spec.head_dim_v)
    return _pad_dim(q, d), _pad_dim(k, d), _pad_dim(v, dv)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The streaming multiprocessors of a CUDA device (the current one for an index-less device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# The launches. Padded layouts (bhsd, bshd) and packed varlen batches (thd) run the same kernels;
# they differ only in the row statistics (lse, Delta, the fp32 dQ accumulator: [B, H, rows] or,
# over the packed rows, [H, rows]) and in the varlen kernels' extra arguments ahead of ``window``:
# ``cu_seqlens_q, cu_seqlens_k`` and the longest sequence (unread by the kernels, whose grids come
# from shapes, ``schedule.py``; the host reads it in :func:`_use_split` and for the deterministic
# dsink partials). ``cu_seqlens`` is None for the padded layouts, else ``(cu_q, cu_k)``, int32 on
# q's device.


def _seq_args(cu_seqlens, longest: int) -> tuple:
    return () if cu_seqlens is None else (*cu_seqlens, longest)


def _stat_shape(spec, q, cu_seqlens) -> tuple:
    if cu_seqlens is None:
        return (spec.batch, spec.heads, padded_rows(spec.seq_q))
    return (spec.heads, varlen_rows(q.shape[0]))


def _use_split(cfg, spec, window, total_q=None) -> bool:
    """Whether the backward runs the ``bwd_split`` main kernel (a GQA group's query heads over
    several programs per KV tile): where the configuration has one and a KV tile sees at least
    BWD_SPLIT_MIN_ROWS rows (long causal or full problems; windowed ones stay unsplit).

    Packed batches (``total_q``: their query rows) decide from their longest sequence,
    ``max_seqlen_q`` (the host knows no other length without a sync), capped by the rows
    themselves (max_seqlen_q may be any bound above the longest). One long sequence among short
    ones splits: its KV tiles' programs are the longest-running, and splitting them shortens the
    kernel's tail; the short sequences' tiles pay the fp32 dK/dV adds (both kernels give the same
    gradients, up to the order of fp32 sums). A max_seqlen_q far above the real longest sequence
    can pick the split kernel where no KV tile sees that many rows: slower, not wrong."""
    if bwd_split(cfg) == 1:
        return False
    longest = spec.seq_q if total_q is None else min(spec.seq_q, total_q)
    rows = longest if not spec.causal else min(longest, window)
    return rows >= BWD_SPLIT_MIN_ROWS


def _stat_shape_kv(spec, k, cu_seqlens) -> tuple:
    """Rows of the fp32 dK/dV accumulators: :func:`_stat_shape` over the keys."""
    if cu_seqlens is None:
        return (spec.batch, spec.kv_heads, padded_rows(spec.seq_kv))
    return (spec.kv_heads, padded_rows(k.shape[0] + ROW_PAD))


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def forward(plan, q, k, v, sinks32, *, o32=False):
    """o (q's layout and dtype) and the row-padded lse (float32, :func:`_stat_shape`). q, k, v and
    ``sinks32`` as :func:`prepare` returned them. ``o32`` (strict, a backward to
    follow): a third result, the output in fp32 from the kind ``fwd_o32`` where the call has it
    (``config.fwd_o32``, a positive scale, not the split decode), else None: what the backward's
    Delta pass reads (:func:`backward`)."""
    spec, cfg, window, cu_seqlens = plan
    if decode.use_split(spec, cfg):  # never for thd
        # few query rows against a long cache: split the keys over programs (decode.py)
        o, lse = decode.forward_split(q, k, v, sinks32, cfg, spec, window, sm_count(q.device),
                                      padded_rows(spec.seq_q))
        return (o, lse, None) if o32 else (o, lse)
    # the kernels' head dim (cfg), not the problem's: q, k, v arrive zero-padded to it
    o = torch.empty((*q.shape[:-1], cfg.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty(_stat_shape(spec, q, cu_seqlens), dtype=torch.float32, device=q.device)
    scale = float(spec.scale)
    seq = _seq_args(cu_seqlens, spec.seq_q)
    if o32 and scale > 0 and fwd_o32(cfg):  # (a scale <= 0 has no folded kernel)
        o_f32 = torch.empty(o.shape, dtype=torch.float32, device=q.device)
        get_kernel("fwd_o32", cfg)(q, k, v, sinks32, *seq, window, scale * LOG2E, o, lse, o_f32)
        return o, lse, o_f32
    # the registry's choice (kinds.forward_kind): fwd_unfolded for a scale <= 0 where the forward folds
    # the scale, fwd_window for a window of at most config.WINDOW_TILES_MAX keys where it has tiles, else fwd
    get_kernel(forward_kind(cfg, window, scale), cfg)(q, k, v, sinks32, *seq, window, scale * LOG2E, o, lse)
    return (o, lse, None) if o32 else (o, lse)


def backward(plan, do, q, k, v, o, lse, dlse, sinks32):
    """dq, dk, dv and dsink (float32 ``[H]``, None without sinks). ``lse`` is the forward's
    row-padded one; ``dlse`` (or None) its gradient over the real rows (seq_q, or total_q).
    ``o``: what the Delta pass reads (Delta = rowsum(dO * O)): fast, the forward's output (contiguous,
    head dims as the kernels saw them); strict, the forward's fp32 output (``forward(o32=True)``), or
    None: Delta then comes from P and dP, recomputed."""
    spec, cfg, window, cu_seqlens = plan
    dev = q.device
    stat = lse.shape  # [B, H, rows] or [H, rows] (thd)
    scale = float(spec.scale)
    f32 = torch.float32
    split = _use_split(cfg, spec, window, None if cu_seqlens is None else q.shape[0])
    # The sink gradient: atomically accumulated in dsink, or (deterministic) one partial per
    # program in dsink_part, summed below in a fixed order. The other buffer is not touched.
    # Each torch call here costs 5-15 us of host time on the H200's host (a slice or a view as much
    # as an allocation: lab/host_parts.py), so every buffer is one call: no slices of one fill,
    # and the buffers no kernel writes (a zero dlse, the unused dsink_part) one view of a buffer
    # kept from call to call (_shared). dsink is its own tensor: it becomes the sinks' gradient.
    if dlse is not None:
        if dlse.shape != stat or dlse.dtype != f32 or not dlse.is_contiguous():
            padded = torch.zeros(stat, dtype=f32, device=dev)
            padded[..., : dlse.shape[-1]] = dlse[..., : stat[-1]]
            dlse = padded
    # Delta's pass: fast's from o; strict's from the forward's fp32 O, or (o None) from P and dP
    pre = "preprocess_o32" if cfg.precision == "strict" and o is not None else "preprocess"
    if cfg.deterministic:
        n_part = -(-spec.seq_q // KINDS[pre].tiles(cfg).block_m)
        dsink_part = torch.zeros((spec.batch, spec.heads, n_part), dtype=f32, device=dev)
        dsink = _unwritten((spec.heads,), dev)
        dq_acc = None
    else:
        # the fp32 dQ accumulator: zeroed by the preprocess, row tile by row tile, before the main
        # backward adds into it (no fill here). With a split main backward (a GQA group over several
        # programs per KV tile) the fp32 dK/dV accumulators are one fill.
        # (head dims: the kernels' own, cfg's; q, k, v, do arrive zero-padded to them)
        d = cfg.head_dim
        dq_acc = torch.empty((*stat, d), dtype=f32, device=dev)
        if split:
            kv_stat = _stat_shape_kv(spec, k, cu_seqlens)
            n_kv = _numel(kv_stat) * d
            zeros = torch.zeros(2 * n_kv, dtype=f32, device=dev)
            dk_acc = zeros[:n_kv].view(*kv_stat, d)
            dv_acc = zeros[n_kv:].view(*kv_stat, d)
        dsink = torch.zeros(spec.heads, dtype=f32, device=dev) if cfg.has_sinks else _unwritten((spec.heads,), dev)
        dsink_part = _unwritten((spec.batch, spec.heads, 1), dev)
    dlse_padded = _zero_stat(stat, dev) if dlse is None else dlse
    delta = torch.empty(stat, dtype=f32, device=dev)
    seq_q, seq_kv = _seq_args(cu_seqlens, spec.seq_q), _seq_args(cu_seqlens, spec.seq_kv)
    acc = () if dq_acc is None else (dq_acc,)  # (deterministic: no dQ accumulator to zero)
    if o is None:
        get_kernel(pre, cfg)(q, k, v, do, lse, dlse_padded, sinks32, *seq_q, window, scale, delta, dsink, dsink_part,
                             *acc)
    else:
        get_kernel(pre, cfg)(o, do, lse, dlse_padded, sinks32, *seq_q, delta, dsink, dsink_part, *acc)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    if cfg.deterministic:
        # dK/dV here, dQ in a second, atomic-free pass; dsink from per-program partials
        # summed in a fixed order: bitwise reproducible.
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dk, dv)
        get_kernel("dq", cfg)(q, k, v, do, lse, delta, *seq_q, window, scale, dq)
        dsink = dsink_part.sum(dim=(0, 2))
    elif split:
        # dK/dV summed in fp32 over the programs sharing a group, then cast like dQ
        get_kernel("bwd_split", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dq_acc, dk_acc, dv_acc)
        post = get_kernel("postprocess", cfg)
        post(dq_acc, dq)
        post(dk_acc, dk)
        post(dv_acc, dv)
    else:
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dq_acc, dk, dv)
        get_kernel("postprocess", cfg)(dq_acc, dq)
    return dq, dk, dv, (dsink if cfg.has_sinks else None)


#: per (kind, device), float32 buffers that no kernel writes, grown (doubling) as needed and
#: handed out as shaped views: "zero", all zeros, the dlse of an unused lse; "unused", what a
#: kernel takes as an argument and neither reads nor writes (the sinks of kernels built without
#: them, the dsink partials outside deterministic mode, dsink in it or without sinks). A buffer outgrown is kept, not freed: a
#: kernel on another stream may still read it (at most the sum of the halvings, under 2x the last).
_SHARED: dict = {}
_OUTGROWN: list = []
#: the views handed out, by (kind, device, shape): a view costs as much host time as an allocation
#: (lab/host_parts.py), so each shape is viewed once. A view of an outgrown buffer stays valid (the
#: buffer is kept, and its contents are what they were: zeros, or never read). Emptied past
#: MAX_VIEWS (packed batches' statistics have a shape per token count).
_VIEWS: dict = {}
MAX_VIEWS = 256


def _shared(kind: str, shape, device):
    key = (kind, device, tuple(shape))
    view = _VIEWS.get(key)
    if view is not None:
        return view
    n = _numel(shape)
    buf = _SHARED.get((kind, device))
    if buf is None or buf.numel() < n:
        size = max(n, 2 * buf.numel()) if buf is not None else n
        if buf is not None:
            _OUTGROWN.append(buf)
        make = torch.zeros if kind == "zero" else torch.empty
        buf = _SHARED[(kind, device)] = make(size, dtype=torch.float32, device=device)
    strides, step = [], 1
    for x in reversed(shape):
        strides.append(step)
        step *= x
    if len(_VIEWS) >= MAX_VIEWS:
        _VIEWS.clear()
    view = _VIEWS[key] = buf.as_strided(tuple(shape), tuple(reversed(strides)))
    return view


def _zero_stat(stat, device):
    """A float32 zero tensor of shape ``stat``, read-only: the dlse of an unused lse."""
    return _shared("zero", stat, device)


def _unwritten(shape, device):
    """A float32 tensor of ``shape`` that the kernels take as an argument and neither read nor write."""
    return _shared("unused", shape, device)


def sinks_f32(sinks, heads, device):
    """The kernels' sinks argument: float32, contiguous, ``[H]`` (an unread buffer without sinks)."""
    if sinks is None:  # kernels built without sinks have no sink term: their sinks argument is unread
        return _unwritten((heads,), device)
    if sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks  # the launchers take autograd leaves as they are (no detach: one call less)
    return sinks.detach().to(torch.float32).contiguous()


def _pad_dim(x, d):
    """Contiguous, with the last dim zero-padded to ``d`` (one copy at most; autograd slices
    the gradient back)."""
    if x.shape[-1] != d:
        return torch.nn.functional.pad(x, (0, d - x.shape[-1]))
    return x if x.is_contiguous() else x.contiguous()
