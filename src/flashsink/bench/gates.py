"""The correctness gate: the float64 reference (chunked, so the largest presets fit) and the
judgement of a system's outputs under the strict and fast precision gates."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import testing
from ..testing import check_fast, check_precision
from .problems import Problem
from .system import System


GATES = ("strict", "fast")  # strongest first: a row's "gate" is the first of these it passes, else "none"


# ----------------------------------------------------------------------------------------------
# Reference (chunked over query heads, so the largest presets fit)

_REF_SCORE_ELEMS = 2**28  # fp64 scores per chunk: 2 GiB per [.., Sq, Skv] tensor


def reference(inp: dict, prob: Problem, *, sinks: bool, compute_dtype) -> dict:
    """o, dq, dk, dv (and dsink) of the reference, in ``compute_dtype``. Chunks over query heads
    within each KV head (dk / dv summed over the chunks), so the score tensor of one chunk stays
    under 2**28 elements even at N = 16k. Varlen: one dense reference per sequence."""
    if prob.seqlens is not None:
        return _reference_varlen(inp, prob, sinks=sinks, compute_dtype=compute_dtype)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    s = inp["sinks"] if sinks else None
    g = prob.heads // prob.kv_heads
    kw = dict(window=prob.window, causal=prob.causal, scale=prob.scale, compute_dtype=compute_dtype)
    per_head = max(1, prob.batch * prob.seq_q * prob.seq_kv)
    if per_head * prob.heads <= _REF_SCORE_ELEMS:
        return testing.reference_grads(q, k, v, s, do, **kw)
    step = max(1, min(g, _REF_SCORE_ELEMS // per_head))
    out = {n: [] for n in ("o", "dq", "dsink")}
    dks, dvs = [], []
    for h in range(prob.kv_heads):
        dk = dv = None
        for j0 in range(0, g, step):
            a, b = h * g + j0, h * g + min(g, j0 + step)
            r = testing.reference_grads(q[:, a:b], k[:, h:h + 1], v[:, h:h + 1], None if s is None else s[a:b],
                                        do[:, a:b], **kw)
            out["o"].append(r["o"])
            out["dq"].append(r["dq"])
            if s is not None:
                out["dsink"].append(r["dsink"])
            dk = r["dk"] if dk is None else dk + r["dk"]
            dv = r["dv"] if dv is None else dv + r["dv"]
        dks.append(dk)
        dvs.append(dv)
    return {
        "o": torch.cat(out["o"], 1), "dq": torch.cat(out["dq"], 1),
        "dk": torch.cat(dks, 1), "dv": torch.cat(dvs, 1),
        "dsink": torch.cat(out["dsink"]) if s is not None else None,
    }


def _reference_varlen(inp: dict, prob: Problem, *, sinks: bool, compute_dtype) -> dict:
    """The varlen reference: :func:`reference` on every sequence as a [1, H, S_i, D] problem, the
    results packed back to [total, H, D] (dsink summed over the sequences)."""
    cu = inp["cu_seqlens"].tolist()
    parts = {n: [] for n in ("o", "dq", "dk", "dv")}
    dsink = None
    for i, n in enumerate(prob.seqlens):
        if n == 0:
            continue
        sub = dataclasses.replace(prob, batch=1, seq_q=n, seq_kv=n, seqlens=None)
        sub_inp = {x: inp[x][cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0) for x in ("q", "k", "v", "do")}
        sub_inp["sinks"] = inp["sinks"]
        r = reference(sub_inp, sub, sinks=sinks, compute_dtype=compute_dtype)
        for x in parts:
            parts[x].append(r[x][0].transpose(0, 1))  # [1, H, S_i, D] -> [S_i, H, D]
        if sinks:
            dsink = r["dsink"] if dsink is None else dsink + r["dsink"]
    return {**{x: torch.cat(v) for x, v in parts.items()}, "dsink": dsink}


# ----------------------------------------------------------------------------------------------
# Gate


def _mode_tensors(mode: str) -> tuple[str, ...]:
    return ("o",) if mode == "fwd" else ("o", "dq", "dk", "dv", "dsink")


@dataclass
class GateResult:
    fwd_ok: bool  # the strict gate (the precision standard)
    bwd_ok: bool
    reports: list = field(default_factory=list)  # PrecisionReport, strict gate
    error: str = ""
    fast_reports: list | None = None  # PrecisionReport, fast gate; None without lowp (--no-gate2)

    def _of(self, mode: str, gate_name: str) -> list:
        reports = self.reports if gate_name == "strict" else (self.fast_reports or [])
        return [r for r in reports if r.name.split("@")[0] in _mode_tensors(mode)]

    def passes(self, mode: str, gate_name: str) -> bool:
        """Every tensor of the mode passes ``gate_name``. Without the fast gate's reports (no lowp),
        "fast" falls back to strict: the only gate there is to judge by."""
        if self.error:
            return False
        if gate_name == "fast" and self.fast_reports is None:
            gate_name = "strict"
        reports = self._of(mode, gate_name)
        if mode != "fwd" and not any(r.name == "dq" for r in reports):
            return False  # no backward was judged
        return bool(reports) and all(r.passed for r in reports)

    def label(self, mode: str) -> str:
        """The strongest gate passed in this mode: "strict", "fast" or "none"."""
        for name in GATES:
            if (name == "strict" or self.fast_reports is not None) and self.passes(mode, name):
                return name
        return "none"

    def failing(self, mode: str, gate_name: str) -> list[str]:
        """Names of the tensors of the mode that fail ``gate_name``."""
        return [r.name for r in self._of(mode, gate_name) if not r.passed]

    def reason(self, mode: str, gate_name: str = "strict") -> str:
        if self.error:
            return self.error
        bad = [f"{r.name}: {r.reason or 'failed'}" for r in self._of(mode, gate_name) if not r.passed]
        return "; ".join(bad)


def gate(system: System, prob: Problem, inp: dict, expected: dict, lowp: dict | None, *, grads: bool) -> GateResult:
    """Run the system forward (+ backward) once and judge it under the precision standard (strict)
    and, when ``lowp`` is given, the fast gate."""
    dt = prob.torch_dtype
    try:
        got = system.gate_outputs(inp, prob, grads)
    except Exception as exc:  # noqa: BLE001 -- a crash is a failed gate, reported like one
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return GateResult(False, False, [], error=msg[:300])
    check = ["o"] + (["dq", "dk", "dv"] + (["dsink"] if system.has_sink else []) if grads else [])
    # other runs of the same tensors ("o@fwd+bwd"): judged against the same reference
    names = check + [n for n in got if "@" in n and n.split("@")[0] in check]

    def judge(fn):
        return [fn(n, got.get(n), expected[n.split("@")[0]], dt,
                   lowp=None if lowp is None else lowp[n.split("@")[0]]) for n in names]

    reports = judge(check_precision)
    fast = None if lowp is None else judge(check_fast)
    fwd_ok = all(r.passed for r in reports if r.name.split("@")[0] == "o")
    bwd_ok = grads and all(r.passed for r in reports)
    return GateResult(fwd_ok, bwd_ok, reports, fast_reports=fast)
