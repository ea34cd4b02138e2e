"""Test inputs and reference gradients: :func:`make_inputs` (seeded random problems), :func:`case_id`,
:func:`reference_grads` (the reference's forward and backward, chunked), :func:`reference_pair` (in
float64 and in the input dtype) and :func:`compare_all` (the reference pair judged by
``_precision.judge_all``). ``flashsink.testing`` re-exports them with the precision gates.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from . import reference
from ._precision import PrecisionReport, resolve_dtype, dtype_name, judge_all
from ._validate import validate_attention
from .kernel_config import PRECISIONS


def case_id(
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    head_dim: int,
    dtype,
    seq_kv: int | None = None,
    window: int | None = None,
    causal: bool = True,
    layout: str = "bhsd",
    sinks: bool = True,
    head_dim_v: int | None = None,
) -> str:
    """Readable parametrize id, e.g. ``B2-H16-HK4-N1000-D64-W100-bf16``."""
    parts = [f"B{batch}", f"H{heads}", f"HK{kv_heads}"]
    if seq_kv is None or seq_kv == seq_q:
        parts.append(f"N{seq_q}")
    else:
        parts.append(f"NQ{seq_q}-NK{seq_kv}")
    parts.append(f"D{head_dim}")
    if head_dim_v is not None and head_dim_v != head_dim:
        parts.append(f"DV{head_dim_v}")
    parts.append("Wnone" if window is None else f"W{window}")
    if not causal:
        parts.append("noncausal")
    if layout != "bhsd":
        parts.append(layout)
    if not sinks:
        parts.append("nosink")
    parts.append(dtype_name(resolve_dtype(dtype)))
    return "-".join(parts)


def make_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    dtype,
    device,
    *,
    layout: str = "bhsd",
    seed: int | None = None,
    sink_range: tuple[float, float] = (-2.0, 2.0),
    sinks: bool = True,
    head_dim_v: int | None = None,
) -> dict:
    """Fresh random inputs: dict with q, k, v, sinks (float32 ``[H]`` uniform in ``sink_range``,
    or None) and do (the output gradient, shaped like the output).

    Values are drawn on the CPU from a generator seeded with ``seed`` (a random seed if None), so
    a seed gives the same tensors on every device.
    """
    dt = resolve_dtype(dtype)
    dv = head_dim if head_dim_v is None else head_dim_v
    if seed is None:
        seed = random.SystemRandom().getrandbits(62)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def shape(h, s, d):
        return (batch, h, s, d) if layout == "bhsd" else (batch, s, h, d)

    def randn(*shp):
        return torch.randn(shp, generator=gen, dtype=torch.float32).to(device=device, dtype=dt)

    out = {
        "q": randn(*shape(heads, seq_q, head_dim)),
        "k": randn(*shape(kv_heads, seq_kv, head_dim)),
        "v": randn(*shape(kv_heads, seq_kv, dv)),
        "sinks": None,
        "do": None,
    }
    if sinks:
        lo, hi = sink_range
        s = torch.rand(heads, generator=gen, dtype=torch.float32) * (hi - lo) + lo
        out["sinks"] = s.to(device)
    out["do"] = randn(*shape(heads, seq_q, dv))
    return out


#: bound on the score elements of one reference chunk (fp64: 2 GiB per [.., S_q, S_kv] tensor);
#: ``flashsink check`` sizes its memory estimate by it
CHUNK_SCORE_ELEMS = 2**28


def _head_dim_index(layout: str) -> int:
    return 1 if layout == "bhsd" else 2


def _upcast(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Cast to ``dt`` only if that is more precise than x's dtype; always a detached copy."""
    if torch.finfo(dt).eps < torch.finfo(x.dtype).eps:
        return x.detach().to(dt)
    return x.detach().clone()


def reference_grads(q, k, v, sinks, do, *, window=None, causal=True, scale=None, layout="bhsd", compute_dtype=None,
                    o_rounded: bool = False) -> dict:
    """Reference forward and backward: dict o, lse, dq, dk, dv, dsink (None without sinks).

    Inputs are detached copies, upcast to ``compute_dtype`` when that is more precise (so
    ``compute_dtype=torch.float64`` gives the exact answer for the given low-precision inputs, and
    ``compute_dtype=q.dtype`` gives what PyTorch computes in that dtype). Large problems are run
    in chunks of KV heads, which is exact: heads never interact.

    ``o_rounded`` (the fast gate's floor, :func:`check_fast`): also the gradients a backward gets when
    it takes Delta = rowsum(dO * O) from O rounded to q's dtype, as every FlashAttention-class backward
    does (O is its input), otherwise exact: entry ``"o_rounded"``, a dict dq, dk, dsink (dv has no
    Delta). Delta enters the gradients linearly, through dS = P (dP - Delta), and ``d lse / d s = P``,
    ``d lse / d sink = exp(sink - lse)``: so they are these gradients plus one more backward pass, of
    lse alone with the cotangent ``-rowsum(dO * (round(O) - O))``.
    """
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=scale, layout=layout)
    cdt = reference.resolve_compute_dtype(q.dtype, compute_dtype)
    hdim = _head_dim_index(layout)
    g = spec.groups
    per_kv_head = max(1, spec.batch * g * spec.seq_q * spec.seq_kv)
    step = max(1, min(spec.kv_heads, CHUNK_SCORE_ELEMS // per_kv_head))

    parts = []
    for h0 in range(0, spec.kv_heads, step):
        h1 = min(spec.kv_heads, h0 + step)
        qs = slice(h0 * g, h1 * g)
        ks = slice(h0, h1)
        leaves = {
            "q": _upcast(q.narrow(hdim, qs.start, qs.stop - qs.start), cdt).requires_grad_(True),
            "k": _upcast(k.narrow(hdim, ks.start, ks.stop - ks.start), cdt).requires_grad_(True),
            "v": _upcast(v.narrow(hdim, ks.start, ks.stop - ks.start), cdt).requires_grad_(True),
        }
        if sinks is not None:
            leaves["sinks"] = _upcast(sinks[qs], cdt).requires_grad_(True)
        dos = _upcast(do.narrow(hdim, qs.start, qs.stop - qs.start), cdt)
        with torch.enable_grad():
            o, lse = reference.attention(
                leaves["q"], leaves["k"], leaves["v"], leaves.get("sinks"), window=window,
                causal=causal, scale=spec.scale, layout=layout, return_lse=True, compute_dtype=cdt,
            )
            grads = torch.autograd.grad(o, list(leaves.values()), dos.to(o.dtype), allow_unused=True,
                                        retain_graph=o_rounded)
            if o_rounded:
                # -rowsum(dO * (round(O) - O)), the rows in lse's [B, H, S_q]; v has no Delta
                ddelta = (dos * (o.detach().to(q.dtype).to(o.dtype) - o.detach())).sum(-1)
                ddelta = ddelta if layout == "bhsd" else ddelta.transpose(1, 2)
                through = {n: x for n, x in leaves.items() if n != "v"}
                extra = dict(zip(through, torch.autograd.grad(lse, list(through.values()), -ddelta.to(lse.dtype),
                                                              materialize_grads=True)))
        grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves.values(), grads)]
        named = dict(zip(leaves.keys(), grads))
        part = {
            "o": o.detach(), "lse": lse.detach(),
            "dq": named["q"], "dk": named["k"], "dv": named["v"], "dsink": named.get("sinks"),
        }
        if o_rounded:
            part["o_rounded"] = {"dq": named["q"] + extra["q"], "dk": named["k"] + extra["k"],
                                 "dsink": None if sinks is None else named["sinks"] + extra["sinks"]}
        parts.append(part)

    if len(parts) == 1:
        return parts[0]
    out = {
        "o": torch.cat([p["o"] for p in parts], dim=hdim),
        "lse": torch.cat([p["lse"] for p in parts], dim=1),
        "dq": torch.cat([p["dq"] for p in parts], dim=hdim),
        "dk": torch.cat([p["dk"] for p in parts], dim=hdim),
        "dv": torch.cat([p["dv"] for p in parts], dim=hdim),
        "dsink": None if sinks is None else torch.cat([p["dsink"] for p in parts], dim=0),
    }
    if o_rounded:
        out["o_rounded"] = {n: None if parts[0]["o_rounded"][n] is None
                            else torch.cat([p["o_rounded"][n] for p in parts], dim=0 if n == "dsink" else hdim)
                            for n in ("dq", "dk", "dsink")}
    return out


def reference_pair(q, k, v, sinks, do, *, window=None, causal=True, scale=None, layout="bhsd", lowp: bool = True,
                   progress: Callable[[str], None] | None = None, lowp_why: str = "gate 2",
                   o_rounded: bool = False) -> tuple[dict, dict | None]:
    """The float64 reference (forward and backward) and, with ``lowp`` (and low-precision inputs),
    the same computed in q's dtype: what :func:`judge_all` judges against. ``o_rounded``: the float64
    reference also carries the gradients with Delta from O rounded to q's dtype (:func:`reference_grads`;
    the fast gate's floor), for low-precision inputs."""
    kw = dict(window=window, causal=causal, scale=scale, layout=layout)
    say = progress or (lambda _msg: None)
    say("reference forward+backward in fp64 ...")
    expected = reference_grads(q, k, v, sinks, do, compute_dtype=torch.float64,
                               o_rounded=o_rounded and q.dtype != torch.float64, **kw)
    low = None
    if lowp and q.dtype != torch.float64:
        say(f"reference forward+backward in {dtype_name(q.dtype)} ({lowp_why}) ...")
        low = reference_grads(q, k, v, sinks, do, compute_dtype=q.dtype, **kw)
    return expected, low


def compare_all(
    actual: dict,
    q,
    k,
    v,
    sinks,
    do,
    *,
    window=None,
    causal=True,
    scale=None,
    layout="bhsd",
    gate2: bool = True,
    progress: Callable[[str], None] | None = None,
    precision: str = "strict",
) -> list[PrecisionReport]:
    """Judge ``actual`` (dict o, lse, dq, dk, dv, dsink) against the float64 reference, under the
    gate of ``precision``: "strict" the precision standard (:func:`check_precision`), "fast" the
    fast gate (:func:`check_fast`).

    Gate 2 (and the fast gate) use the reference computed in q's dtype; "strict" skips it for float64
    inputs or ``gate2=False``, "fast" needs it. ``dsink`` is skipped when ``sinks`` is None.
    ``progress`` receives a line before each slow step.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fast" and (not gate2 or q.dtype == torch.float64):
        raise ValueError("precision='fast' judges against the reference in the input dtype: it needs gate2=True "
                         f"and fp16/bf16/fp32 inputs (got gate2={gate2}, {dtype_name(q.dtype)})")
    expected, lowp = reference_pair(q, k, v, sinks, do, window=window, causal=causal, scale=scale, layout=layout,
                                    lowp=gate2, progress=progress,
                                    lowp_why="fast gate" if precision == "fast" else "gate 2",
                                    o_rounded=precision == "fast")
    return judge_all(actual, expected, lowp, q.dtype, precision=precision)
