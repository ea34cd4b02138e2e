"""``flashsink.attention`` on CUDA tensors: input preparation and launches.

``_forward`` / ``_backward`` launch the kernels; the custom ops ``flashsink::fwd`` /
``flashsink::bwd`` (``custom_ops.py``) wrap them with fake implementations and autograd, and
``kernel_attention`` pads head dims and calls the forward op. Validation happened once, in the
public function (``flashsink.api``). Nothing here imports tilelang: kernels are built on first launch.
"""

import functools

import torch

from . import decode
from .compile import get_kernel
from .config import LOG2E, MAX_HEAD_DIM, NATIVE_HEAD_DIMS, SUPPORTED_DTYPES, KernelConfig, arch_of, pre_tiles

# Row statistics (lse, Delta) and the fp32 dQ accumulator are allocated with this many
# rows per multiple: every kernel's row tile is then in bounds, and the row stride of
# an fp32 [.., rows] tensor stays 16-byte aligned as the bulk-copy engine requires.
ROW_PAD = 128


def _padded_rows(seq_q: int) -> int:
    # sym_max: also right for the symbolic lengths of a torch.compile trace (no guard on seq_q).
    return torch.sym_max(ROW_PAD, (seq_q + ROW_PAD - 1) // ROW_PAD * ROW_PAD)


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


def kernel_config(spec, device, deterministic: bool) -> KernelConfig:
    """The static configuration for a validated problem, or NotImplementedError."""
    check_supported(spec)
    return KernelConfig(
        arch=arch_of(device),
        dtype=SUPPORTED_DTYPES[spec.dtype],
        head_dim=_kernel_dim(spec.head_dim),
        head_dim_v=_kernel_dim(spec.head_dim_v),
        groups=spec.heads // spec.kv_heads,
        causal=spec.causal,
        has_sinks=spec.has_sinks,
        layout=spec.layout,
        deterministic=bool(deterministic),
    )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _forward(q, k, v, sinks32, cfg, spec, window):
    B, H, Sq = spec.batch, spec.heads, spec.seq_q
    if decode.use_split(spec, cfg):
        # few query rows against a long cache: split the keys over programs (decode.py)
        sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
        return decode.forward_split(q, k, v, sinks32, cfg, spec, window, sms, _padded_rows(Sq))
    o_shape = (B, H, Sq, spec.head_dim_v) if cfg.layout == "bhsd" else (B, Sq, H, spec.head_dim_v)
    o = torch.empty(o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, _padded_rows(Sq)), dtype=torch.float32, device=q.device)
    get_kernel("fwd", cfg)(q, k, v, sinks32, window, float(spec.scale) * LOG2E, o, lse)
    return o, lse


def _backward(do, q, k, v, lse, dlse, sinks32, cfg, spec, window):
    B, H, Sq = spec.batch, spec.heads, spec.seq_q
    dev = q.device
    rows = lse.shape[-1]
    scale = float(spec.scale)
    delta = torch.empty((B, H, rows), dtype=torch.float32, device=dev)
    dlse_padded = torch.zeros((B, H, rows), dtype=torch.float32, device=dev)
    if dlse is not None:
        dlse_padded[:, :, :Sq] = dlse
    dsink = torch.zeros((H,), dtype=torch.float32, device=dev)
    n_part = -(-Sq // pre_tiles(cfg).block_m) if cfg.deterministic else 1
    dsink_part = torch.zeros((B, H, n_part), dtype=torch.float32, device=dev)
    get_kernel("preprocess", cfg)(q, k, v, do, lse, dlse_padded, sinks32, window, scale, delta, dsink, dsink_part)

    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q)
    if cfg.deterministic:
        # dK/dV here, dQ in a second, atomic-free pass; dsink from per-program partials
        # summed in a fixed order: bitwise reproducible.
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, window, scale, dk, dv)
        get_kernel("dq", cfg)(q, k, v, do, lse, delta, window, scale, dq)
        dsink = dsink_part.sum(dim=(0, 2))
    else:
        dq_acc = torch.zeros((B, H, rows, spec.head_dim), dtype=torch.float32, device=dev)
        get_kernel("bwd", cfg)(q, k, v, do, lse, delta, window, scale, dq_acc, dk, dv)
        get_kernel("postprocess", cfg)(dq_acc, dq)
    return dq, dk, dv, (dsink if cfg.has_sinks else None)


def _sinks_f32(sinks, heads, device):
    if sinks is None:
        return torch.zeros((heads,), dtype=torch.float32, device=device)  # not read by the kernels
    return sinks.detach().to(torch.float32).contiguous()


def kernel_attention(spec, q, k, v, sinks, *, return_lse=False, deterministic=False):
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
        q, k, v, sinks, spec.window, spec.causal, spec.scale, spec.layout, deterministic
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
