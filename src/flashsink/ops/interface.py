"""``flashsink.attention`` on CUDA tensors: input preparation and launches.

``_forward`` / ``_backward`` launch the kernels, for the padded layouts and (with ``cu_seqlens``,
from ``varlen.py``) packed varlen batches alike; the custom ops ``flashsink::fwd`` /
``flashsink::bwd`` (``custom_ops.py``) wrap them with fake implementations and autograd, and
``kernel_attention`` pads head dims and calls the forward op. Validation happened once, in the
public function (``flashsink.api``). Nothing here imports tilelang: kernels are built on first launch.
"""

import functools

import torch

from . import decode
from .compile import get_kernel
from .config import (
    LOG2E, MAX_HEAD_DIM, NATIVE_HEAD_DIMS, PRECISIONS, SUPPORTED_DTYPES, KernelConfig, arch_of, bwd_split, pre_tiles,
)

# Row statistics (lse, Delta) and the fp32 dQ accumulator are allocated with this many
# rows per multiple: every kernel's row tile is then in bounds, and the row stride of
# an fp32 [.., rows] tensor stays 16-byte aligned as the bulk-copy engine requires.
ROW_PAD = 128


def _padded_rows(seq_q: int) -> int:
    rows = (seq_q + ROW_PAD - 1) // ROW_PAD * ROW_PAD
    if isinstance(rows, int):  # eager: plain ints (torch.sym_max costs microseconds per call)
        return max(ROW_PAD, rows)
    # a torch.compile trace: symbolic lengths, no guard on seq_q
    return torch.sym_max(ROW_PAD, rows)


def _kernel_dim(d: int) -> int:
    """Head dim the kernels run with: tiles are built for these sizes; other multiples of 16
    are zero-padded up to the next one (exact: zero columns add nothing to q.k, and the
    padded columns of o, dq, dk, dv are dropped)."""
    for native in NATIVE_HEAD_DIMS:
        if d <= native:
            return native
    raise AssertionError(d)  # unreachable after check_supported


def check_supported(spec) -> None:
    """NotImplementedError unless the kernels take this (validated) problem's dtype and head dims."""
    if spec.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"flashsink kernels support float16 and bfloat16 inputs on CUDA; got {spec.dtype}. "
            "Cast q, k, v to one of those, or use flashsink.reference.attention for other dtypes."
        )
    for name, d in (("head_dim of q and k", spec.head_dim), ("head_dim of v", spec.head_dim_v)):
        if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
            raise NotImplementedError(
                f"flashsink kernels support head dims that are multiples of 16 up to {MAX_HEAD_DIM} "
                f"(64 and 128 are the fast ones); the {name} is {d}."
            )


#: kernel_config's results by the facts they depend on: built and checked once per configuration
_CONFIGS: dict = {}


def kernel_config(spec, device, deterministic: bool, precision: str = "fast") -> KernelConfig:
    """The static configuration for a validated problem, or NotImplementedError."""
    arch = arch_of(device)
    groups = spec.heads // spec.kv_heads
    key = (arch, spec.dtype, spec.head_dim, spec.head_dim_v, groups, spec.causal, spec.has_sinks, spec.layout,
           bool(deterministic), precision)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        check_supported(spec)
        if precision not in PRECISIONS:  # the public functions checked it; the ops may be called directly
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        cfg = _CONFIGS[key] = KernelConfig(
            arch=arch,
            dtype=SUPPORTED_DTYPES[spec.dtype],
            head_dim=_kernel_dim(spec.head_dim),
            head_dim_v=_kernel_dim(spec.head_dim_v),
            groups=groups,
            causal=spec.causal,
            has_sinks=spec.has_sinks,
            layout=spec.layout,
            deterministic=bool(deterministic),
            precision=precision,
        )
    return cfg


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The launches. Padded layouts (bhsd, bshd) and packed varlen batches (thd) run the same kernels;
# they differ only in the row statistics (lse, Delta, the fp32 dQ accumulator: [B, H, rows] or,
# over the packed rows, [H, rows]) and in the varlen kernels' extra arguments ahead of ``window``:
# ``cu_seqlens_q, cu_seqlens_k`` and the longest sequence, which sizes the grid. ``cu_seqlens``
# is None for the padded layouts, else ``(cu_q, cu_k)``, int32 on q's device.


def _seq_args(cu_seqlens, longest: int) -> tuple:
    return () if cu_seqlens is None else (*cu_seqlens, longest)


def _stat_shape(spec, q, cu_seqlens) -> tuple:
    if cu_seqlens is None:
        return (spec.batch, spec.heads, _padded_rows(spec.seq_q))
    # whole row tiles of the last packed sequence may start at any row: one tile past the end
    # (varlen._rows, which the custom ops' fake shapes use, is the same formula)
    return (spec.heads, _padded_rows(q.shape[0] + ROW_PAD))


def _stat_shape_kv(spec, k, cu_seqlens) -> tuple:
    """Rows of the fp32 dK/dV accumulators: :func:`_stat_shape` over the keys."""
    if cu_seqlens is None:
        return (spec.batch, spec.kv_heads, _padded_rows(spec.seq_kv))
    return (spec.kv_heads, _padded_rows(k.shape[0] + ROW_PAD))


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _forward(q, k, v, sinks32, cfg, spec, window, cu_seqlens=None):
    """o (q's layout and dtype) and the row-padded lse (float32, :func:`_stat_shape`)."""
    if decode.use_split(spec, cfg):  # never for thd
        # few query rows against a long cache: split the keys over programs (decode.py)
        sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
        return decode.forward_split(q, k, v, sinks32, cfg, spec, window, sms, _padded_rows(spec.seq_q))
    o = torch.empty((*q.shape[:-1], spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty(_stat_shape(spec, q, cu_seqlens), dtype=torch.float32, device=q.device)
    get_kernel("fwd", cfg)(
        q, k, v, sinks32, *_seq_args(cu_seqlens, spec.seq_q), window, float(spec.scale) * LOG2E, o, lse
    )
    return o, lse


def _backward(do, q, k, v, o, lse, dlse, sinks32, cfg, spec, window, cu_seqlens=None):
    """dq, dk, dv and dsink (float32 ``[H]``, None without sinks). ``lse`` is the forward's
    row-padded one; ``dlse`` (or None) its gradient over the real rows (seq_q, or total_q).
    ``o``: the forward's output (contiguous, head dims as the kernels saw them), read by the fast
    preprocess (Delta = rowsum(dO * O)); None, and not read, for strict."""
    dev = q.device
    stat = tuple(lse.shape)  # [B, H, rows] or [H, rows] (thd)
    scale = float(spec.scale)
    n_stat = lse.numel()
    split = 1 if cfg.deterministic else bwd_split(cfg)
    if cfg.deterministic:
        dq_acc = None
        dlse_padded = torch.zeros(stat, dtype=torch.float32, device=dev)
    else:
        # one zero fill for the dQ accumulator, dlse and (when the main backward shares a GQA group
        # over several programs) the dK/dV accumulators, all zeroed before the launches read them;
        # every part is a multiple of ROW_PAD rows long, so each starts 512-byte aligned
        kv_stat = _stat_shape_kv(spec, k, cu_seqlens) if split > 1 else ()
        n_kv = _numel(kv_stat) * spec.head_dim if split > 1 else 0
        zeros = torch.zeros(n_stat * (spec.head_dim + 1) + 2 * n_kv, dtype=torch.float32, device=dev)
        dq_acc, dlse_padded, dk_acc, dv_acc = zeros.split((n_stat * spec.head_dim, n_stat, n_kv, n_kv))
        dq_acc, dlse_padded = dq_acc.view(*stat, spec.head_dim), dlse_padded.view(stat)
    if dlse is not None:
        dlse_padded[..., : dlse.shape[-1]] = dlse
    delta = torch.empty(stat, dtype=torch.float32, device=dev)
    # The sink gradient: atomically accumulated in dsink, or (deterministic) one partial per
    # program in dsink_part, summed below in a fixed order. The other buffer is not touched.
    n_part = -(-spec.seq_q // pre_tiles(cfg).block_m) if cfg.deterministic else 1
    if cfg.deterministic:
        dsink = torch.empty((spec.heads,), dtype=torch.float32, device=dev)
        dsink_part = torch.zeros((spec.batch, spec.heads, n_part), dtype=torch.float32, device=dev)
    else:
        dsink = torch.zeros((spec.heads,), dtype=torch.float32, device=dev)
        dsink_part = torch.empty((spec.batch, spec.heads, n_part), dtype=torch.float32, device=dev)
    seq_q, seq_kv = _seq_args(cu_seqlens, spec.seq_q), _seq_args(cu_seqlens, spec.seq_kv)
    if cfg.precision == "strict":
        get_kernel("preprocess", cfg)(
            q, k, v, do, lse, dlse_padded, sinks32, *seq_q, window, scale, delta, dsink, dsink_part
        )
    else:
        get_kernel("preprocess", cfg)(o, do, lse, dlse_padded, sinks32, *seq_q, delta, dsink, dsink_part)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    if cfg.deterministic:
        # dK/dV here, dQ in a second, atomic-free pass; dsink from per-program partials
        # summed in a fixed order: bitwise reproducible.
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dk, dv)
        get_kernel("dq", cfg)(q, k, v, do, lse, delta, *seq_q, window, scale, dq)
        dsink = dsink_part.sum(dim=(0, 2))
    elif split > 1:
        # dK/dV summed in fp32 over the programs sharing a group, then cast like dQ
        dk_acc, dv_acc = dk_acc.view(*kv_stat, spec.head_dim), dv_acc.view(*kv_stat, spec.head_dim)
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dq_acc, dk_acc, dv_acc)
        post = get_kernel("postprocess", cfg)
        post(dq_acc, dq)
        post(dk_acc, dk)
        post(dv_acc, dv)
    else:
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, *seq_kv, window, scale, dq_acc, dk, dv)
        get_kernel("postprocess", cfg)(dq_acc, dq)
    return dq, dk, dv, (dsink if cfg.has_sinks else None)


def _sinks_f32(sinks, heads, device):
    if sinks is None:
        # read by no kernel without sinks (their code has no sink term), so not filled
        return torch.empty((heads,), dtype=torch.float32, device=device)
    return sinks.detach().to(torch.float32).contiguous()


def kernel_attention(spec, q, k, v, sinks, *, return_lse=False, deterministic=False, precision="fast"):
    """Run validated inputs through the kernels (autograd for q, k, v and sinks).

    Everything here is traceable by torch.compile (fullgraph, dynamic shapes): the launches are
    behind the custom ops ``flashsink::fwd`` / ``flashsink::bwd`` (``custom_ops.py``), whose
    autograd formula calls the backward op. Head-dim padding and the slicing of o and lse are
    plain torch ops around them, so autograd slices and pads the gradients.
    """
    check_supported(spec)
    if 0 in (spec.batch, spec.heads, spec.seq_q, spec.seq_kv):
        # Empty problems (no rows, or no keys: o = 0 and lse = the sink) have no tiles to
        # launch; the reference gives their exact, differentiable result on q's device.
        from .. import reference

        return reference._attention(q, k, v, sinks, spec, return_lse=return_lse)
    d, dv = _kernel_dim(spec.head_dim), _kernel_dim(spec.head_dim_v)
    q, k = (_pad_dim(x, d) for x in (q, k))
    v = _pad_dim(v, dv)
    # lse comes back with _padded_rows(seq_q) rows (the layout the backward kernels read).
    o, lse = torch.ops.flashsink.fwd(
        q, k, v, sinks, spec.window, spec.causal, spec.scale, spec.layout, deterministic, precision
    )
    if dv != spec.head_dim_v:
        o = o[..., : spec.head_dim_v]
    return (o, lse[:, :, : spec.seq_q]) if return_lse else o


def _pad_dim(x, d):
    """Contiguous, with the last dim zero-padded to ``d`` (one copy at most; autograd slices
    the gradient back)."""
    if x.shape[-1] != d:
        return torch.nn.functional.pad(x, (0, d - x.shape[-1]))
    return x if x.is_contiguous() else x.contiguous()


from . import custom_ops  # noqa: E402,F401  (registers flashsink::fwd / flashsink::bwd; it reads this module's names at call time)
