"""Argument validation shared by the reference and the kernels.

Every user error is a TypeError (wrong kind of object) or a ValueError (right kind, wrong value)
whose message names the argument, what was given and what is needed. Nothing here asserts, except
the varlen value checks while torch.compile traces (see ``_assert_cu_seqlens``).
The result, an :class:`AttnSpec`, holds every static fact about the problem, so callers never
re-derive shapes from the tensors.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from .kernel_config import PRECISIONS, padded_rows, varlen_rows  # the lse rows the ops return (a leaf: torch only)

LAYOUTS = ("bhsd", "bshd")
#: input dtypes of q, k, v and sinks (the reference computes in float32, or float64 for float64;
#: the CUDA kernels take float16 and bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The largest |scale| whose product with log2(e) (the kernels' base-2 scores) is finite in float32:
# the kernels, and the reference for inputs other than float64, scale the scores in float32.
_MAX_SCALE_F32 = torch.finfo(torch.float32).max / math.log2(math.e)
# Windows at least this wide see every key of any sequence: clamped here, so that a huge int (2**64)
# never overflows the int64 / int32 arithmetic of the masks.
_MAX_WINDOW = 1 << 62


@dataclass(frozen=True)
class AttnSpec:
    """Static description of one attention problem, of checked arguments (every validator ends here).

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

    def __post_init__(self):
        # on the type, so no spec escapes them: the default scale 1/sqrt(head_dim), and the window
        # clamped to what the masks' integer arithmetic holds
        object.__setattr__(self, "window", spec_window(self.window))
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)
        object.__setattr__(self, "scale", scale)

    @property
    def groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.heads // self.kv_heads

    def one_sequence(self, seq_q, seq_kv) -> "AttnSpec":
        """One sequence of a packed (``thd``) batch on its own: batch 1, layout ``bshd``."""
        return dataclasses.replace(self, batch=1, seq_q=seq_q, seq_kv=seq_kv, layout="bshd")

    @property  # not cached: a spec serves one launch, and functools.cached_property takes a lock (3.11)
    def kernel_key(self) -> tuple:
        """The facts of the problem its kernels' configuration depends on, in the order of
        ``dense._config_of`` (``dense.kernel_config`` adds the device's architecture,
        ``deterministic`` and ``precision``): never a length, so one configuration serves every length."""
        return (self.dtype, self.head_dim, self.head_dim_v, self.heads // self.kv_heads, self.causal,
                self.has_sinks, self.layout)


def shape_text(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_flags(**flags) -> None:
    """TypeError unless every value is a bool (``return_lse="no"`` is truthy: never guess)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def check_choice(name: str, value, choices: tuple) -> None:
    """ValueError naming the choices unless ``value`` is one of them (a str)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_precision(precision) -> str:
    """``precision`` as given, or ValueError naming the choices (shared by the functions, the module,
    the integrations and the custom ops)."""
    check_choice("precision", precision, PRECISIONS)
    return precision


def check_strided(name: str, t) -> None:
    """TypeError unless the tensor ``t`` is dense (layout torch.strided, not nested): a sparse or nested
    tensor would otherwise fail deep inside torch with its own message. A nested tensor of the strided
    layout reports ``layout == torch.strided`` but has no sizes, so it is told apart by ``is_nested``."""
    if t.is_nested:
        raise TypeError(
            f"{name} must be a dense tensor, got a nested tensor (layout {t.layout}); pack its sequences "
            f"into one [total_tokens, heads, head_dim] tensor and call flashsink.attention_varlen with their "
            f"cu_seqlens (or pad them: torch.nested.to_padded_tensor)"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense tensor (layout torch.strided), got layout {t.layout}; convert it with .to_dense()"
        )


def check_tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32 or float64), "
            f"got {t.dtype}"
        )


def check_options(window, causal, scale) -> None:
    check_flags(causal=causal)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (numbers.Integral, torch.SymInt)):
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


def _check_scale_dtype(scale, dtype: torch.dtype) -> None:
    if scale is not None and dtype != torch.float64 and not abs(float(scale)) <= _MAX_SCALE_F32:
        raise ValueError(
            f"scale must be finite in float32 (|scale| <= {_MAX_SCALE_F32:.3g}): scores of {dtype} inputs "
            f"are scaled in float32, where {scale!r} overflows; got scale={scale!r}"
        )


def spec_window(window):
    if window is None or isinstance(window, torch.SymInt):  # symbolic (the ops' fakes): no guard on it
        return window
    return min(int(window), _MAX_WINDOW)


def check_sinks(sinks, heads: int, device: torch.device) -> None:
    if sinks is None:
        return
    check_tensor("sinks", sinks)
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(
            f"sinks must be 1-D of shape [{heads}] (one logit per query head), got shape {shape_text(sinks)}"
        )
    if sinks.device != device:
        raise ValueError(
            f"sinks must be on the same device as q ({device}), got {sinks.device}; move it with .to(q.device)"
        )


def check_same_dtype_device(q, k, v) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            f"cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )


def check_heads(heads: int, kv_heads: int, head_dim: int, head_dim_v: int, what) -> None:
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


#: validate_attention's results by everything its checks read (types, shapes, dtypes and devices of the
#: tensors; the options' values and types): the checks read no tensor values, so arguments with the same
#: key pass or fail alike. A call costs ~8-15 us of host time checking, ~1.5 us looking up (eager calls;
#: a torch.compile trace always checks). Emptied past MAX_SPECS.
_SPECS: dict = {}
MAX_SPECS = 1024
#: option types whose values key the memo (a tensor scale, say, is checked every call)
_PLAIN = (type(None), bool, int, float, str)


def _spec_key(q, k, v, sinks, window, causal, scale, layout):
    """The memo key of :func:`validate_attention`'s arguments, or None where they are not plain."""
    if not (type(window) in _PLAIN and type(causal) in _PLAIN and type(scale) in _PLAIN and type(layout) in _PLAIN):
        return None
    try:
        return (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                v.device, q.layout, k.layout, v.layout,
                None if sinks is None else (type(sinks), sinks.shape, sinks.dtype, sinks.device, sinks.layout),
                type(window), window, type(causal), causal, type(scale), scale, layout)
    except (AttributeError, RuntimeError):  # not tensors, or nested ones (no sizes): the checks say what is wrong
        return None


def validate_attention(q, k, v, sinks, *, window, causal, scale, layout) -> AttnSpec:
    """Check the arguments of ``attention`` and return the problem's :class:`AttnSpec`.

    Layout ``"bhsd"``: q ``[B, H, S_q, D]``, k ``[B, H_kv, S_kv, D]``, v ``[B, H_kv, S_kv, D_v]``.
    Layout ``"bshd"``: q ``[B, S_q, H, D]``, k ``[B, S_kv, H_kv, D]``, v ``[B, S_kv, H_kv, D_v]``.
    """
    key = None if _tracing() else _spec_key(q, k, v, sinks, window, causal, scale, layout)
    try:
        spec = None if key is None else _SPECS.get(key)
    except TypeError:  # symbolic shapes (the ops' fake implementations, outside a dynamo trace): not keys
        key = spec = None
    if spec is None:
        spec = _validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
        if key is not None:
            if len(_SPECS) >= MAX_SPECS:
                _SPECS.clear()
            _SPECS[key] = spec
    return spec


def _validate_attention(q, k, v, sinks, *, window, causal, scale, layout) -> AttnSpec:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if sinks is not None:
        check_tensor("sinks", sinks)
    check_options(window, causal, scale)
    check_choice("layout", layout, LAYOUTS)
    what = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {what} for layout={layout!r}, got {t.dim()}-D shape {shape_text(t)}"
            )
    check_same_dtype_device(q, k, v)
    _check_scale_dtype(scale, q.dtype)

    if layout == "bhsd":
        b, h, sq, d = q.shape
        bk, hk, skv, dk = k.shape
        bv, hv, sv, dv = v.shape
    else:
        b, sq, h, d = q.shape
        bk, skv, hk, dk = k.shape
        bv, sv, hv, dv = v.shape
    if bk != b:
        raise ValueError(f"k batch ({bk}) must equal q batch ({b}); q {shape_text(q)}, k {shape_text(k)}")
    if dk != d:
        raise ValueError(
            f"k head_dim ({dk}) must equal q head_dim ({d}); q {shape_text(q)}, k {shape_text(k)}"
        )
    if (bv, hv, sv) != (bk, hk, skv):
        raise ValueError(
            f"v must match k in batch, heads and sequence length ({layout}): k {shape_text(k)}, v {shape_text(v)}"
        )
    check_heads(h, hk, d, dv, lambda: f"layout={layout!r}, q {shape_text(q)}, k {shape_text(k)}, v {shape_text(v)}")
    check_sinks(sinks, h, q.device)

    return AttnSpec(b, h, hk, sq, skv, d, dv, window=window, causal=causal, scale=scale, layout=layout,
                    dtype=q.dtype, has_sinks=sinks is not None)


def _tracing() -> bool:
    """True while torch.compile (dynamo) traces: values in tensors cannot be read on the host then."""
    return torch.compiler.is_compiling()


def _check_cu_structure(name: str, cu, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(cu).__name__}")
    check_strided(name, cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 entries (cumulative lengths starting at 0), "
            f"got shape {shape_text(cu)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")


def _check_cu_values(name: str, vals: list[int], total) -> None:
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


def _check_max_seqlen_type(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0:  # a guard on a symbolic int under tracing
        raise ValueError(f"{name} must be >= the longest sequence (>= 0), got {value}")


def _check_max_seqlen(name: str, value, vals: list[int]) -> None:
    longest = max((b - a for a, b in zip(vals[:-1], vals[1:])), default=0)
    if value < longest:
        raise ValueError(f"{name} must be >= the longest sequence ({longest}), got {value}")


# The custom ops check the offsets' values where they run (ops_check_varlen). On CUDA that is with
# tensor asserts (torch._assert_async: no host sync, so the ops stay traceable and capturable in a
# CUDA graph); they fail with a device-side assert (a RuntimeError that ends the CUDA context) naming
# the argument and the rule, not the offending value, which stays on the device. Offsets that
# attention_varlen checked on the host (a ValueError with the values) are not checked again while the
# tensor is unchanged: same object, same version counter, same total and max_seqlen.
_DEVICE = " (checked on the device; call flashsink.attention_varlen eagerly for the ValueError with the values)"
_CHECKED = torch.utils.weak.WeakIdKeyDictionary()  # offsets tensor -> (version, total, max_seqlen)


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: never remembered
        return None


def _remember(cu, total, max_seqlen) -> None:
    version = _version(cu)
    if cu.is_cuda and version is not None:
        _CHECKED[cu] = (version, total, max_seqlen)


def _checked(cu, total, max_seqlen) -> bool:
    """Whether these offsets were checked (on the host, or by the device asserts) and not changed since."""
    return _CHECKED.get(cu) == (_version(cu), total, max_seqlen)


def _assert_cu_seqlens(name: str, cu, total, max_seqlen) -> None:
    if _checked(cu, total, max_seqlen):
        return
    torch._assert_async(cu[0] == 0, f"{name} must start at 0{_DEVICE}")
    lens = cu[1:] - cu[:-1]
    torch._assert_async((lens >= 0).all(), f"{name} must be non-decreasing{_DEVICE}")
    rows = "q.shape[0]" if name.endswith("_q") else "k.shape[0]"
    torch._assert_async(cu[-1] == total, f"{name}[-1] must equal the total number of tokens ({rows}){_DEVICE}")
    which = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
    torch._assert_async((lens <= max_seqlen).all(), f"{which} must be >= the longest sequence in {name}{_DEVICE}")
    _remember(cu, total, max_seqlen)


def _varlen_values(cu_q, cu_k, tq, tk, max_q, max_k) -> None:
    """Host checks of the offsets and the max_seqlen bounds (one copy of each tensor)."""
    cq = cu_q.detach().cpu().tolist()
    ck = cu_k.detach().cpu().tolist()
    _check_cu_values("cu_seqlens_q", cq, tq)
    _check_cu_values("cu_seqlens_k", ck, tk)
    _check_max_seqlen("max_seqlen_q", max_q, cq)
    _check_max_seqlen("max_seqlen_k", max_k, ck)
    _remember(cu_q, tq, max_q)
    _remember(cu_k, tk, max_k)


def _int(n):
    return n if isinstance(n, torch.SymInt) else int(n)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window, causal, scale):
    """Everything but the offsets' values; returns the spec."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if sinks is not None:
        check_tensor("sinks", sinks)
    check_options(window, causal, scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for varlen attention, "
                f"got {t.dim()}-D shape {shape_text(t)}"
            )
    check_same_dtype_device(q, k, v)
    _check_scale_dtype(scale, q.dtype)
    tq, h, d = q.shape
    tk, hk, dk = k.shape
    tv, hv, dv = v.shape
    if dk != d:
        raise ValueError(f"k head_dim ({dk}) must equal q head_dim ({d}); q {shape_text(q)}, k {shape_text(k)}")
    if (tv, hv) != (tk, hk):
        raise ValueError(
            f"v must match k in total tokens and heads: k {shape_text(k)}, v {shape_text(v)}"
        )
    check_heads(h, hk, d, dv, lambda: f"varlen, q {shape_text(q)}, k {shape_text(k)}, v {shape_text(v)}")
    check_sinks(sinks, h, q.device)
    _check_cu_structure("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_structure("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    _check_max_seqlen_type("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen_type("max_seqlen_k", max_seqlen_k)
    return AttnSpec(cu_seqlens_q.shape[0] - 1, h, hk, _int(max_seqlen_q), _int(max_seqlen_k), d, dv, window=window,
                    causal=causal, scale=scale, layout="thd", dtype=q.dtype, has_sinks=sinks is not None)


def validate_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, *, window, causal, scale
) -> AttnSpec:
    """Check the arguments of ``attention_varlen`` (THD layout) and return its :class:`AttnSpec`.

    q ``[total_q, H, D]``, k ``[total_k, H_kv, D]``, v ``[total_k, H_kv, D_v]``; sequence ``i`` is
    rows ``cu_seqlens[i]:cu_seqlens[i+1]``. The returned spec has ``layout="thd"``, ``batch`` = number
    of sequences, ``seq_q`` / ``seq_kv`` = ``max_seqlen_q`` / ``max_seqlen_k``.
    """
    spec = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window, causal, scale
    )
    # The offsets' values: on the host here, eagerly, for a ValueError with the values. Under tracing
    # (no host reads) and on meta tensors (no values) the ops check them where they run (check_varlen_op).
    # CUDA offsets already checked and unchanged since (the same tensor, its version counter, total and
    # max_seqlen: the layers of one step share them) are not copied again: the copy waits for the GPU,
    # which made every eager varlen call as slow as its host path (H200, docs/perf-log.md v11).
    tq, tk = q.shape[0], k.shape[0]
    if (not _tracing() and cu_seqlens_q.device.type != "meta"
            and not (_checked(cu_seqlens_q, tq, max_seqlen_q) and _checked(cu_seqlens_k, tk, max_seqlen_k))):
        _varlen_values(cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k)
    return spec


# ------------------------------------------------------------------------------------------------
# The custom ops torch.ops.flashsink.fwd / bwd / varlen_fwd / varlen_bwd are public names: their
# implementations (and fake implementations) check their arguments as the public functions do, with
# the same code. These take the ops' own argument lists. Cheap: shape and type checks in Python (a
# few microseconds, no host-device sync); the varlen offsets' values as described at _CHECKED.


def check_op(q, k, v, sinks, window, causal, scale, layout) -> AttnSpec:
    """``flashsink::fwd``: the checks of :func:`validate_attention` (``scale`` is required)."""
    if scale is None:
        raise TypeError("scale must be a float for the flashsink ops (flashsink.attention defaults it)")
    return validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)


def out_shape(spec: AttnSpec, q) -> tuple:
    """Shape of o: q's, with v's head dim (every layout: bhsd, bshd, thd)."""
    return (*q.shape[:-1], spec.head_dim_v)


def _check_grad(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    check_tensor(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {list(shape)} on {device}, "
            f"got {t.dtype} {shape_text(t)} on {t.device}"
        )


def _check_grads(do, lse, dlse, o_shape: tuple, lse_shape: tuple, q) -> None:
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    _check_grad("do", do, o_shape, q.dtype, q.device)
    _check_grad("lse", lse, lse_shape, lse_dtype, q.device)
    if dlse is not None:
        _check_grad("dlse", dlse, lse_shape, lse_dtype, q.device)


def check_bwd_op(do, q, k, v, sinks, lse, dlse, window, causal, scale, layout) -> AttnSpec:
    """``flashsink::bwd``: :func:`check_op`, and do / lse / dlse shaped as ``flashsink::fwd`` returns o / lse."""
    spec = check_op(q, k, v, sinks, window, causal, scale, layout)
    _check_grads(do, lse, dlse, out_shape(spec, q), (spec.batch, spec.heads, padded_rows(spec.seq_q)), q)
    return spec


def check_varlen_op(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal,
                    scale, values: bool = True) -> AttnSpec:
    """``flashsink::varlen_fwd``: the checks of :func:`validate_varlen`, the offsets' values included
    (``values``): on the host off CUDA (where the reference reads them anyway), with device asserts on CUDA."""
    if scale is None:
        raise TypeError("scale must be a float for the flashsink ops (flashsink.attention_varlen defaults it)")
    spec = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, window, causal, scale
    )
    if not values or cu_seqlens_q.device.type == "meta" or _tracing():
        return spec  # no values to read
    tq, tk = q.shape[0], k.shape[0]
    if cu_seqlens_q.is_cuda:
        _assert_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq, max_seqlen_q)
        _assert_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tk, max_seqlen_k)
    else:
        _varlen_values(cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k)
    return spec


def check_varlen_bwd_op(do, q, k, v, sinks, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        window, causal, scale, values: bool = True) -> AttnSpec:
    """``flashsink::varlen_bwd``: :func:`check_varlen_op`, and do / lse / dlse shaped as ``varlen_fwd``
    returns o / lse."""
    spec = check_varlen_op(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, causal,
                           scale, values)
    _check_grads(do, lse, dlse, out_shape(spec, q), (spec.heads, varlen_rows(q.shape[0])), q)
    return spec


def check_op_options(deterministic, precision, o=None) -> None:
    """The ops' arguments beyond the public functions' checks: ``deterministic`` a bool, ``precision``
    one of the modes, the saved output ``o`` (backward ops) a tensor or None."""
    check_flags(deterministic=deterministic)
    check_precision(precision)
    if o is not None:
        check_tensor("o", o)
