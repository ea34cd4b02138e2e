"""Argument validation shared by the reference and the kernels.

Every user error is a TypeError (wrong kind of object) or a ValueError (right kind, wrong value)
whose message names the argument, what was given and what is needed. Nothing here asserts, except
the varlen value checks while torch.compile traces (see ``_assert_cu_seqlens``).
The result, an :class:`AttnSpec`, holds every static fact about the problem, so callers never
re-derive shapes from the tensors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

LAYOUTS = ("bhsd", "bshd")


@dataclass(frozen=True)
class AttnSpec:
    """Static description of one attention problem.

    For varlen problems (``layout == "thd"``) ``batch`` is the number of sequences and
    ``seq_q`` / ``seq_kv`` are ``max_seqlen_q`` / ``max_seqlen_k``.
    """

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    window: int | None
    causal: bool
    scale: float
    layout: str
    dtype: torch.dtype
    has_sinks: bool

    @property
    def groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.heads // self.kv_heads


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32 or float64), "
            f"got {t.dtype}"
        )


def _check_options(window, causal, scale) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} ({causal!r})")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(
                f"window must be an int (number of keys a query sees, itself included) or None, "
                f"got {type(window).__name__} ({window!r})"
            )
        if window < 1:
            raise ValueError(
                f"window must be >= 1 (window W covers keys [i-W+1, i]), got {window}; "
                f"pass window=None for no sliding window"
            )
        if not causal:
            raise ValueError(
                f"a sliding window needs causal=True: window={window} was given with causal=False; "
                f"pass causal=True, or window=None for full non-causal attention"
            )
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(
                f"scale must be a real number or None (default 1/sqrt(head_dim)), "
                f"got {type(scale).__name__} ({scale!r})"
            )
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale!r}")


def _check_sinks(sinks, heads: int, device: torch.device) -> None:
    if sinks is None:
        return
    _check_tensor("sinks", sinks)
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(
            f"sinks must be 1-D of shape [{heads}] (one logit per query head), got shape {_shape(sinks)}"
        )
    if sinks.device != device:
        raise ValueError(
            f"sinks must be on the same device as q ({device}), got {sinks.device}; move it with .to(q.device)"
        )


def _check_same_dtype_device(q, k, v) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            f"cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )


def _check_heads(heads: int, kv_heads: int, head_dim: int, head_dim_v: int, what) -> None:
    """``what`` describes the inputs in the messages: a str, or a callable giving one, so that the
    description is only built on an error (formatting symbolic shapes breaks a torch.compile graph)."""
    if not (heads < 1 or kv_heads < 1 or heads % kv_heads != 0 or head_dim < 1 or head_dim_v < 1):
        return
    if callable(what):
        what = what()
    if heads < 1 or kv_heads < 1:
        raise ValueError(
            f"q and k need at least one head, got q heads {heads} and k/v heads {kv_heads} ({what})"
        )
    if heads % kv_heads != 0:
        raise ValueError(
            f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads}) for grouped-query "
            f"attention ({what})"
        )
    if head_dim < 1 or head_dim_v < 1:
        raise ValueError(
            f"head dims must be >= 1, got q/k head_dim {head_dim} and v head_dim {head_dim_v} ({what})"
        )


def validate_attention(q, k, v, sinks, *, window, causal, scale, layout) -> AttnSpec:
    """Check the arguments of ``attention`` and return the problem's :class:`AttnSpec`.

    Layout ``"bhsd"``: q ``[B, H, S_q, D]``, k ``[B, H_kv, S_kv, D]``, v ``[B, H_kv, S_kv, D_v]``.
    Layout ``"bshd"``: q ``[B, S_q, H, D]``, k ``[B, S_kv, H_kv, D]``, v ``[B, S_kv, H_kv, D_v]``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if sinks is not None:
        _check_tensor("sinks", sinks)
    _check_options(window, causal, scale)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    what = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {what} for layout={layout!r}, got {t.dim()}-D shape {_shape(t)}"
            )
    _check_same_dtype_device(q, k, v)

    if layout == "bhsd":
        b, h, sq, d = q.shape
        bk, hk, skv, dk = k.shape
        bv, hv, sv, dv = v.shape
    else:
        b, sq, h, d = q.shape
        bk, skv, hk, dk = k.shape
        bv, sv, hv, dv = v.shape
    if bk != b:
        raise ValueError(f"k batch ({bk}) must equal q batch ({b}); q {_shape(q)}, k {_shape(k)}")
    if dk != d:
        raise ValueError(
            f"k head_dim ({dk}) must equal q head_dim ({d}); q {_shape(q)}, k {_shape(k)}"
        )
    if (bv, hv, sv) != (bk, hk, skv):
        raise ValueError(
            f"v must match k in batch, heads and sequence length ({layout}): k {_shape(k)}, v {_shape(v)}"
        )
    _check_heads(h, hk, d, dv, lambda: f"layout={layout!r}, q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    _check_sinks(sinks, h, q.device)

    return AttnSpec(
        batch=b,
        heads=h,
        kv_heads=hk,
        seq_q=sq,
        seq_kv=skv,
        head_dim=d,
        head_dim_v=dv,
        window=None if window is None else int(window),
        causal=causal,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        layout=layout,
        dtype=q.dtype,
        has_sinks=sinks is not None,
    )


def _tracing() -> bool:
    """True while torch.compile (dynamo) traces: values in tensors cannot be read on the host then."""
    return torch.compiler.is_compiling()


def _check_cu_seqlens(name: str, cu, total, device: torch.device) -> list[int] | None:
    """The offsets as a host list (eager), or None under tracing, where the value checks are
    tensor asserts in the graph instead (see ``_assert_cu_seqlens``)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 entries (cumulative lengths starting at 0), "
            f"got shape {_shape(cu)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")
    if _tracing():
        _assert_cu_seqlens(name, cu, total)
        return None
    vals = cu.detach().cpu().tolist()  # one host copy, checked in Python
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i - 1}] = {vals[i - 1]} > "
                f"{name}[{i}] = {vals[i]}"
            )
    if vals[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal the total number of tokens ({total}), got {vals[-1]}"
        )
    return vals


# Under torch.compile the checks of the offsets' values are the same conditions as tensor asserts
# (torch._assert_async) in the graph: reading the values on the host (.tolist(), .item()) would break
# it. They fail at run time with a RuntimeError (on CUDA: a device-side assert, which ends the CUDA
# context) whose message names the argument and the rule, but not the offending value, which stays on
# the device. Nothing is skipped; run the call eagerly for the ValueError with the values.
_TRACED = " (checked in the compiled graph; call eagerly for the ValueError with the values)"


def _assert_cu_seqlens(name: str, cu, total) -> None:
    torch._assert_async(cu[0] == 0, f"{name} must start at 0{_TRACED}")
    torch._assert_async((cu[1:] >= cu[:-1]).all(), f"{name} must be non-decreasing{_TRACED}")
    rows = "q.shape[0]" if name.endswith("_q") else "k.shape[0]"
    torch._assert_async(cu[-1] == total, f"{name}[-1] must equal the total number of tokens ({rows}){_TRACED}")


def _check_max_seqlen_type(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")


def _check_max_seqlen(name: str, value, lengths: list[int]) -> int:
    _check_max_seqlen_type(name, value)
    longest = max(lengths, default=0)
    if value < longest:
        raise ValueError(
            f"{name} must be >= the longest sequence ({longest}), got {value}"
        )
    return int(value)


def _assert_max_seqlen(name: str, value, cu):
    """Traced twin of ``_check_max_seqlen``: the sign is a guard on the (symbolic) int, the bound a
    tensor assert over the lengths."""
    _check_max_seqlen_type(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= the longest sequence (>= 0), got {value}")
    which = "q" if name.endswith("_q") else "k"
    torch._assert_async(
        (cu[1:] - cu[:-1] <= value).all(),
        f"{name} must be >= the longest sequence in cu_seqlens_{which}{_TRACED}",
    )
    return value


def validate_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, *, window, causal, scale
) -> AttnSpec:
    """Check the arguments of ``attention_varlen`` (THD layout) and return its :class:`AttnSpec`.

    q ``[total_q, H, D]``, k ``[total_k, H_kv, D]``, v ``[total_k, H_kv, D_v]``; sequence ``i`` is
    rows ``cu_seqlens[i]:cu_seqlens[i+1]``. The returned spec has ``layout="thd"``, ``batch`` = number
    of sequences, ``seq_q`` / ``seq_kv`` = ``max_seqlen_q`` / ``max_seqlen_k``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if sinks is not None:
        _check_tensor("sinks", sinks)
    _check_options(window, causal, scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for varlen attention, "
                f"got {t.dim()}-D shape {_shape(t)}"
            )
    _check_same_dtype_device(q, k, v)
    tq, h, d = q.shape
    tk, hk, dk = k.shape
    tv, hv, dv = v.shape
    if dk != d:
        raise ValueError(f"k head_dim ({dk}) must equal q head_dim ({d}); q {_shape(q)}, k {_shape(k)}")
    if (tv, hv) != (tk, hk):
        raise ValueError(
            f"v must match k in total tokens and heads: k {_shape(k)}, v {_shape(v)}"
        )
    _check_heads(h, hk, d, dv, lambda: f"varlen, q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    _check_sinks(sinks, h, q.device)

    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq, q.device)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tk, q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if cq is None:  # tracing: the bounds are asserts in the graph; max_seqlen may be a SymInt
        mq = _assert_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
        mk = _assert_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    else:
        lens_q = [b - a for a, b in zip(cq[:-1], cq[1:])]
        lens_k = [b - a for a, b in zip(ck[:-1], ck[1:])]
        mq = _check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
        mk = _check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)

    return AttnSpec(
        batch=cu_seqlens_q.shape[0] - 1,
        heads=h,
        kv_heads=hk,
        seq_q=mq,
        seq_kv=mk,
        head_dim=d,
        head_dim_v=dv,
        window=None if window is None else int(window),
        causal=causal,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        layout="thd",
        dtype=q.dtype,
        has_sinks=sinks is not None,
    )
