"""The precision standard of flashsink: its gates (:func:`check_precision`, :func:`check_fast`,
:func:`judge_all`), their tolerances and reports. ``flashsink.testing`` re-exports them with the
inputs and reference gradients of ``_cases.py``.

Expected values come from the reference computed in float64 on the *same* low-precision inputs,
so the only error being judged is the implementation's own arithmetic.

Gate 1 (double gate), per tensor:
    * at least 99% of the elements satisfy ``|a - e| <= atol + rtol * |e|``, and
    * ``max |a - e| <= 0.1``.

Gate 2 (FlashAttention-style, robust to magnitudes), when ``lowp`` is given -- the reference
computed in the low-precision dtype itself, i.e. what plain PyTorch would give:
    * ``max |a - e| <= 2 * max |lowp - e| + atol_small``.

Composed values (``composed=True``, ``lowp`` required): a model's logits and parameter gradients
reach the kernel's output through further low-precision layers, each rounding again, so one ulp of
difference in an attention output spreads over many elements and no exact attention reaches 99%
(in a bf16 model, neither does the model's own eager attention). For them gate 1's share is
relative: at least ``min(99%, share of lowp - 2%)``, lowp being the same model with its own
low-precision attention; gate 1's max bound and gate 2 are unchanged. The kernel's own outputs are
never judged this way.

A tensor passes when gate 1 passes and, if ``lowp`` is given, gate 2 passes too. A non-finite
actual value where the expected value is finite always fails; matching infinities (lse = -inf in
rows that see no key and have no sink) count as exact. Empty tensors pass.

Tolerances, one logic for every format. The outputs of a fused kernel are rounded once to the
output format, and that final rounding (half an ulp, relative) dominates the fp32 accumulation
error inside the kernel. So:
    * rtol = 2 ulp at 1 of the format (= 4 unit roundoffs): the final rounding plus the same again
      of headroom for the rounding of intermediates (P is rounded to the input dtype before P @ V).
    * atol = rtol / 32: the floor below which an element is judged absolutely, for elements that
      are small only through cancellation (o is a weighted mean of values of size ~1; its error
      follows the size of v, not of o).
    * atol_small (gate 2) = 1 ulp at 1 of the format: FlashAttention's ``2 * |x + 0.3 - 0.3 - x|``,
      the rounding noise of one add at magnitude ~1, which keeps gate 2 meaningful when the
      low-precision reference is (nearly) exact.

    fp16: ulp(1) = 2^-10  -> rtol 2^-9  = 1.95e-3, atol 2^-14 = 6.10e-5 (also fp16's smallest
          normal), atol_small 2^-10 = 9.77e-4.  These are the seed's numbers.
    bf16: ulp(1) = 2^-7   -> rtol 2^-6  = 1.56e-2, atol 2^-11 = 4.88e-4, atol_small 2^-7 = 7.81e-3.
    fp32: ulp(1) = 2^-23 would give rtol 2^-22 = 2.4e-7, but in fp32 the final rounding no longer
          dominates: the fp32 reductions themselves do (dot products over D, sums over up to N
          keys or queries), whose error grows like sqrt(length) ulps. The unit is therefore the
          error of a 4096-term fp32 reduction, sqrt(4096) * 2^-23 = 2^-17, and, as above,
          rtol = 2 units = 2^-16 = 1.53e-5, atol = rtol / 32 = 2^-21 = 4.77e-7, atol_small = 1 unit
          = 2^-17 = 7.63e-6. Measured: the fp32 reference against the fp64 one keeps > 99.9% of
          elements inside these at N=512, D=128. They assume true fp32 arithmetic (no TF32).

The lse and dsink tensors are float32 in every flashsink API, but they are computed from
low-precision inputs; they are judged with the tolerances of the problem's input dtype.

The fast gate (``precision="fast"``, :func:`check_fast`), per tensor: the error class of
FlashAttention-4, FLA and flex (single-term products in the input dtype), held to what plain PyTorch
gets on the same problem in that dtype. With ``lowp`` the reference computed in the input dtype (the
lowp of gate 2, required here) and ``u`` the dtype's unit roundoff (eps / 2: 2^-11 fp16, 2^-8 bf16):
    * L2 gate: ``||a - e|| <= FAST_FACTOR * max(||lowp - e||, u * ||e||)``, FAST_FACTOR = 1.5; the
      report shows it relative, ``||a - e|| / ||e||`` against ``1.5 * max(||lowp - e|| / ||e||, u)``.
    * element guard: ``max |a - e| <= FAST_MAX_FACTOR * max |lowp - e| + atol_small``, FAST_MAX_FACTOR
      = 4 (twice gate 2's factor). An L2 norm over millions of elements hides a few wrong ones (one
      wrong row per head of a 16k-token tensor is within 1.5x); FlashAttention's own tests hold a kernel
      to 2x torch's low-precision max error, so 4x only catches what is wrong, not what is fast.
Edge cases:
    * ``lowp`` exactly right (||lowp - e|| = 0: the answer is representable, or the problem is trivial):
      1.5 * 0 would fail any implementation that rounds differently. The floor ``u * ||e||`` is the
      most that rounding the exact answer once to the dtype can cost (each element at most u relative),
      so the correctly rounded exact answer always passes and nothing worse than 1.5 roundings does.
    * the gradients' floor of O's rounding (``o_rounded``, what :func:`compare_all` passes in fast mode):
      ``||e_O - e||`` with ``e_O`` the exact gradients with Delta = rowsum(dO * O) from O rounded to
      the dtype (:func:`reference_grads`), an error every backward that takes the stored O inherits.
      It is far below torch's own error on most problems (~0.2 u against ~1.4 u at 96 tokens), but at
      one visible key dS = P (1 - P) dO.v cancels where P is near 1, O's rounding dominates, and torch
      in the dtype can be lucky: the kernel's arithmetic failed 16 of 2,000 seeds of the GPU suite's
      N=1 case without this floor and none with it (docs/perf-log.md v25). L2 bound and element guard:
      ``1.5 * max(||lowp - e||, u * ||e||, ||e_O - e||)``, ``4 * max(max |lowp - e|, max |e_O - e|) +
      atol_small``.
    * ``e`` all zero: the floor is 0, so the bound is ``1.5 * ||lowp||`` (exact zeros when lowp is).
    * empty tensors pass. A missing or misshapen ``actual`` fails.
    * non-finite: as in the standard, a non-finite actual where the expected value is finite fails
      (its error is inf), matching infinities (lse = -inf of rows without keys or sink) count exact and
      leave ``||e||`` (over the finite elements of e); an expected NaN fails. A lowp that is non-finite
      where e is finite does not widen the bound: those elements are left out of lowp's error (stricter).
    * lse and dsink are float32 outputs, but the lowp reference computes them in the input dtype, and
      ``u`` is the input dtype's, like the standard's tolerances: the gate asks no more than PyTorch in
      that dtype gives (a kernel accumulating in fp32 passes them with room).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernel_config import PRECISIONS  # the gate of each mode: check_fast ("fast"), check_precision ("strict")

MIN_RATIO = 0.99  # gate 1: share of elements within atol + rtol * |e|
MAX_ABS_LIMIT = 0.1  # gate 1: max |a - e|
GATE2_FACTOR = 2.0  # gate 2: max |a - e| <= GATE2_FACTOR * max |lowp - e| + atol_small
# composed values (a model's logits and parameter gradients, downstream of the kernel through other
# low-precision ops): gate 1's share may fall to the lowp system's own share minus this margin
COMPOSED_MARGIN = 0.02
# the fast gate: ||a - e|| <= FAST_FACTOR * max(||lowp - e||, u * ||e||), and
# max |a - e| <= FAST_MAX_FACTOR * max |lowp - e| + atol_small
FAST_FACTOR = 1.5
FAST_MAX_FACTOR = 4.0


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    atol_small: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=2.0**-14, rtol=2.0**-9, atol_small=2.0**-10),
    torch.bfloat16: Tolerance(atol=2.0**-11, rtol=2.0**-6, atol_small=2.0**-7),
    torch.float32: Tolerance(atol=2.0**-21, rtol=2.0**-16, atol_small=2.0**-17),
}

_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}
_DTYPE_ALIASES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name: fp16, bf16, fp32, fp64."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def resolve_dtype(dtype) -> torch.dtype:
    """A torch.dtype, or its name (``"bf16"``, ``"float16"``, ...), as the torch.dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPE_ALIASES)}, got {dtype!r}")


def tolerance(dtype) -> Tolerance:
    """The tolerances of the precision standard for ``dtype`` (fp16, bf16 or fp32)."""
    dt = resolve_dtype(dtype)
    if dt not in TOLERANCES:
        raise ValueError(
            f"the precision standard covers fp16, bf16 and fp32, got {dt}; "
            f"compare float64 results directly with a max-abs bound"
        )
    return TOLERANCES[dt]


# ----------------------------------------------------------------------------------------------
# Reports


@dataclass
class PrecisionReport:
    """Outcome of :func:`check_precision` for one tensor."""

    name: str
    dtype: str
    shape: tuple
    max_abs: float
    ratio: float
    passed: bool
    atol: float
    rtol: float
    gate1_ratio_ok: bool
    gate1_max_ok: bool
    gate2_limit: float | None = None  # 2 * lowp_max_abs + atol_small, when lowp was given
    gate2_ok: bool | None = None
    lowp_max_abs: float | None = None
    lowp_ratio: float | None = None  # lowp's share within tolerance, when lowp was given
    reason: str = ""
    timing: str = ""  # free text filled by callers that time the op (e.g. "fwd 1.2 ms")
    gate: str = "strict"  # which gate decided `passed`: "strict" (check_precision) or "fast" (check_fast)
    rel_l2: float | None = None  # ||a - e|| / ||e|| (absolute when e is all zero)
    lowp_rel_l2: float | None = None  # the same of lowp, when lowp was given
    l2_limit: float | None = None  # fast gate: FAST_FACTOR * max(lowp_rel_l2, u)

    _COLUMNS = (
        ("tensor", 7, "<"),
        ("dtype", 5, "<"),
        ("shape", 20, "<"),
        ("gate", 6, "<"),
        ("max |a-e|", 10, ">"),
        ("within tol", 10, ">"),
        ("gate-2 lim", 10, ">"),  # the bound on max |a-e| (fast: its element guard)
        ("rel L2", 9, ">"),
        ("L2 lim", 9, ">"),
        ("result", 6, "<"),
        ("time", 14, "<"),
    )

    @classmethod
    def header(cls) -> str:
        cells = [f"{title:{align}{width}}" for title, width, align in cls._COLUMNS]
        return "  ".join(cells) + "  reason"

    def row(self) -> str:
        shape = "[" + ",".join(str(s) for s in self.shape) + "]"
        values = (
            self.name,
            self.dtype,
            shape,
            self.gate,
            f"{self.max_abs:.3e}",
            f"{100.0 * self.ratio:.3f}%",
            _fmt(self.gate2_limit),
            _fmt(self.rel_l2, ".2e"),
            _fmt(self.l2_limit, ".2e"),
            "PASS" if self.passed else "FAIL",
            self.timing,
        )
        cells = [f"{val:{align}{width}}" for val, (_, width, align) in zip(values, self._COLUMNS)]
        return "  ".join(cells) + "  " + self.reason

    def __str__(self) -> str:
        return self.header() + "\n" + self.row()


def _fmt(x: float | None, spec: str = ".3e") -> str:
    return "-" if x is None else format(x, spec)


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - e| in float64; matching infinities count 0, any other non-finite pair inf."""
    err = (actual - expected).abs()
    same_inf = torch.isinf(expected) & (actual == expected)
    err = torch.where(same_inf, torch.zeros((), dtype=err.dtype, device=err.device), err)
    return torch.nan_to_num(err, nan=math.inf)


def check_precision(name: str, actual, expected, dtype, *, lowp=None, composed: bool = False) -> PrecisionReport:
    """Judge ``actual`` against ``expected`` (float64 reference) under the precision standard.

    ``dtype`` picks the tolerances (the problem's input dtype). ``lowp``, if given, is the
    reference computed in the low-precision dtype and turns on gate 2.

    ``composed=True`` is for values that reach the kernel's output through other low-precision
    operations (a bf16 model's logits and parameter gradients: every later layer rounds again, so a
    one-ulp difference in the attention output spreads over many elements). There no exact system
    reaches 99% within tolerance, the model's own eager attention included; gate 1's share is then
    relative: at least ``min(99%, lowp's share - COMPOSED_MARGIN)``. ``lowp`` (the same model with its
    own low-precision attention) is required; gate 1's max bound and gate 2 are unchanged.
    """
    if composed and lowp is None:
        raise ValueError(f"{name}: composed=True needs lowp (the low-precision system whose share it is judged against)")
    dt = resolve_dtype(dtype)
    tol = tolerance(dt)
    shape = tuple(expected.shape)
    base = dict(name=name, dtype=dtype_name(dt), shape=shape, atol=tol.atol, rtol=tol.rtol)

    def fail(reason: str) -> PrecisionReport:
        return PrecisionReport(
            **base, max_abs=math.inf, ratio=0.0, passed=False,
            gate1_ratio_ok=False, gate1_max_ok=False, reason=reason,
        )

    if actual is None:
        return fail("actual is missing (None)")
    if tuple(actual.shape) != shape:
        return fail(f"shape {list(actual.shape)} != expected {list(shape)}")
    if lowp is not None and tuple(lowp.shape) != shape:
        raise ValueError(f"{name}: lowp shape {list(lowp.shape)} != expected {list(shape)}")
    if expected.numel() == 0:
        return PrecisionReport(
            **base, max_abs=0.0, ratio=1.0, passed=True, gate1_ratio_ok=True, gate1_max_ok=True,
            reason="empty",
        )

    e = expected.detach().to(torch.float64)
    a = actual.detach().to(device=e.device, dtype=torch.float64)
    err = _errors(a, e)
    max_abs = float(err.max())
    within = err <= tol.atol + tol.rtol * e.abs()
    ratio = float(within.double().mean())
    lowp_ratio = min_ratio = None
    if lowp is not None:
        low = lowp.detach().to(device=e.device, dtype=torch.float64)
        lowp_err = _errors(low, e)
        lowp_ratio = float((lowp_err <= tol.atol + tol.rtol * e.abs()).double().mean())
    min_ratio = min(MIN_RATIO, lowp_ratio - COMPOSED_MARGIN) if composed else MIN_RATIO
    ratio_ok = ratio >= min_ratio
    max_ok = max_abs <= MAX_ABS_LIMIT

    reasons = []
    bad_nonfinite = int((~torch.isfinite(a) & torch.isfinite(e)).sum())
    if bad_nonfinite:
        reasons.append(f"{bad_nonfinite} non-finite where expected is finite")
    if torch.isnan(e).any():
        reasons.append("expected contains NaN")
    if not ratio_ok:
        if composed:
            reasons.append(f"only {100 * ratio:.3f}% within tol (< {100 * min_ratio:.3f}%: "
                           f"lowp's {100 * lowp_ratio:.3f}% - {100 * COMPOSED_MARGIN:g}%)")
        else:
            reasons.append(f"only {100 * ratio:.3f}% within tol (< {100 * MIN_RATIO:.0f}%)")
    if not max_ok:
        reasons.append(f"max abs err {max_abs:.3e} > {MAX_ABS_LIMIT}")

    gate2_limit = gate2_ok = lowp_max = None
    if lowp is not None:
        lowp_max = float(lowp_err.max())
        gate2_limit = GATE2_FACTOR * lowp_max + tol.atol_small
        gate2_ok = max_abs <= gate2_limit
        if not gate2_ok:
            reasons.append(
                f"gate 2: {max_abs:.3e} > {GATE2_FACTOR:g} * {lowp_max:.3e} (torch {dtype_name(dt)}) "
                f"+ {tol.atol_small:.2e}"
            )

    passed = ratio_ok and max_ok and not bad_nonfinite and gate2_ok is not False
    e_norm = _l2(e, finite_only=True)
    return PrecisionReport(
        **base, max_abs=max_abs, ratio=ratio, passed=passed, gate1_ratio_ok=ratio_ok,
        gate1_max_ok=max_ok, gate2_limit=gate2_limit, gate2_ok=gate2_ok, lowp_max_abs=lowp_max,
        lowp_ratio=lowp_ratio, reason="; ".join(reasons), rel_l2=_rel(_l2(err), e_norm),
        lowp_rel_l2=None if lowp is None else _rel(_l2(lowp_err), e_norm),
    )


def assert_precision(name: str, actual, expected, dtype, *, lowp=None, composed: bool = False) -> PrecisionReport:
    """:func:`check_precision` that raises AssertionError carrying the table row on failure."""
    report = check_precision(name, actual, expected, dtype, lowp=lowp, composed=composed)
    if not report.passed:
        raise AssertionError("precision standard failed\n" + str(report))
    return report


def _l2(x: torch.Tensor, *, finite_only: bool = False) -> float:
    """L2 norm in float64; ``finite_only``: over the finite elements (||e|| next to matching infinities)."""
    if finite_only:
        x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return float(torch.linalg.vector_norm(x.flatten().double()))


def _rel(err_norm: float, e_norm: float) -> float:
    return err_norm / e_norm if e_norm > 0 else err_norm


def check_fast(name: str, actual, expected, dtype, *, lowp, o_rounded=None) -> PrecisionReport:
    """Judge ``actual`` against ``expected`` (float64 reference) under the fast gate (module
    docstring): ``||a - e|| <= FAST_FACTOR * max(||lowp - e||, u * ||e||, ||o_rounded - e||)`` and
    ``max |a - e| <= FAST_MAX_FACTOR * max(max |lowp - e|, max |o_rounded - e|) + atol_small``.

    ``dtype`` is the problem's input dtype (u and atol_small); ``lowp`` the same problem computed by
    :mod:`flashsink.reference` in that dtype (required). ``o_rounded`` (optional, a gradient's): the
    exact gradient with Delta from O rounded to ``dtype`` (:func:`reference_grads`), the error a backward
    that takes the stored O cannot avoid. The report's gate-1 fields (share within tolerance, max
    bound) are filled for information; ``passed`` is the fast gate's verdict.
    """
    if lowp is None:
        raise ValueError(f"{name}: the fast gate needs lowp (the reference computed in the input dtype)")
    dt = resolve_dtype(dtype)
    tol = tolerance(dt)
    u = torch.finfo(dt).eps / 2
    shape = tuple(expected.shape)
    base = dict(name=name, dtype=dtype_name(dt), shape=shape, atol=tol.atol, rtol=tol.rtol, gate="fast")
    if tuple(lowp.shape) != shape:
        raise ValueError(f"{name}: lowp shape {list(lowp.shape)} != expected {list(shape)}")
    if o_rounded is not None and tuple(o_rounded.shape) != shape:
        raise ValueError(f"{name}: o_rounded shape {list(o_rounded.shape)} != expected {list(shape)}")
    if actual is None or tuple(actual.shape) != shape:
        why = "actual is missing (None)" if actual is None else f"shape {list(actual.shape)} != expected {list(shape)}"
        return PrecisionReport(**base, max_abs=math.inf, ratio=0.0, passed=False, gate1_ratio_ok=False,
                               gate1_max_ok=False, reason=why)
    if expected.numel() == 0:
        return PrecisionReport(**base, max_abs=0.0, ratio=1.0, passed=True, gate1_ratio_ok=True,
                               gate1_max_ok=True, reason="empty")

    e = expected.detach().to(torch.float64)
    a = actual.detach().to(device=e.device, dtype=torch.float64)
    low = lowp.detach().to(device=e.device, dtype=torch.float64)
    err = _errors(a, e)
    lowp_err = _errors(low, e)
    reasons = []
    lowp_bad = ~torch.isfinite(low) & torch.isfinite(e)
    if lowp_bad.any():  # left out of lowp's error: a non-finite lowp must not widen the bound
        reasons.append(f"lowp non-finite at {int(lowp_bad.sum())} elements (left out of its error)")
        lowp_err = torch.where(lowp_bad, torch.zeros((), dtype=lowp_err.dtype, device=e.device), lowp_err)
    e_norm = _l2(e, finite_only=True)
    err_norm, lowp_norm = _l2(err), _l2(lowp_err)
    o_norm = o_max = 0.0
    if o_rounded is not None:  # finite where e is, else left out (as lowp's): it may not widen the bound
        o_err = _errors(o_rounded.detach().to(device=e.device, dtype=torch.float64), e)
        o_err = torch.where(torch.isfinite(o_err), o_err, torch.zeros((), dtype=o_err.dtype, device=e.device))
        o_norm, o_max = _l2(o_err), float(o_err.max())
    l2_bound = FAST_FACTOR * max(lowp_norm, u * e_norm, o_norm)
    max_abs, lowp_max = float(err.max()), float(lowp_err.max())
    max_limit = FAST_MAX_FACTOR * max(lowp_max, o_max) + tol.atol_small
    l2_ok = err_norm <= l2_bound
    max_ok = max_abs <= max_limit
    ratio = float((err <= tol.atol + tol.rtol * e.abs()).double().mean())

    bad_nonfinite = int((~torch.isfinite(a) & torch.isfinite(e)).sum())
    if bad_nonfinite:
        reasons.append(f"{bad_nonfinite} non-finite where expected is finite")
    expected_nan = bool(torch.isnan(e).any())
    if expected_nan:
        reasons.append("expected contains NaN")
    rel, lowp_rel = _rel(err_norm, e_norm), _rel(lowp_norm, e_norm)
    l2_limit = _rel(l2_bound, e_norm)
    if not l2_ok:
        o_floor = f", O rounded {_rel(o_norm, e_norm):.3e}" if o_rounded is not None else ""
        reasons.append(f"rel L2 {rel:.3e} > {FAST_FACTOR:g} * max({lowp_rel:.3e} (torch {dtype_name(dt)}), "
                       f"u {u:.2e}{o_floor})")
    if not max_ok:
        o_max_txt = f", O rounded {o_max:.3e}" if o_rounded is not None else ""
        reasons.append(f"max abs err {max_abs:.3e} > {FAST_MAX_FACTOR:g} * max({lowp_max:.3e} (torch "
                       f"{dtype_name(dt)}){o_max_txt}) + {tol.atol_small:.2e}")
    passed = l2_ok and max_ok and not bad_nonfinite and not expected_nan
    return PrecisionReport(
        **base, max_abs=max_abs, ratio=ratio, passed=passed, gate1_ratio_ok=ratio >= MIN_RATIO,
        gate1_max_ok=max_abs <= MAX_ABS_LIMIT, gate2_limit=max_limit, gate2_ok=max_ok, lowp_max_abs=lowp_max,
        reason="; ".join(reasons), rel_l2=rel, lowp_rel_l2=lowp_rel, l2_limit=l2_limit,
    )


def assert_fast(name: str, actual, expected, dtype, *, lowp) -> PrecisionReport:
    """:func:`check_fast` that raises AssertionError carrying the table row on failure."""
    report = check_fast(name, actual, expected, dtype, lowp=lowp)
    if not report.passed:
        raise AssertionError("fast precision gate failed\n" + str(report))
    return report


TENSORS = ("o", "lse", "dq", "dk", "dv", "dsink")


def judge_all(actual: dict, expected: dict, lowp: dict | None, dtype, *, precision: str = "strict") -> list[PrecisionReport]:
    """Every tensor of :data:`TENSORS` in ``expected`` (dsink only when it is not None) under the gate
    of ``precision``: "strict" :func:`check_precision` (gate 2 when ``lowp`` is given), "fast"
    :func:`check_fast` (``lowp`` required)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fast" and lowp is None:
        raise ValueError("precision='fast' judges against the reference in the input dtype: lowp is required")
    names = [n for n in TENSORS if expected.get(n) is not None]
    low = lowp or {}
    if precision == "fast":
        rounded = expected.get("o_rounded") or {}
        return [check_fast(n, actual.get(n), expected[n], dtype, lowp=low[n], o_rounded=rounded.get(n)) for n in names]
    return [check_precision(n, actual.get(n), expected[n], dtype, lowp=low.get(n)) for n in names]
