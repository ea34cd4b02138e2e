"""The attention stack of ``flashsink bench`` (presets ``gptoss-stack-4k`` / ``gptoss-stack-16k``, and the chain
of ``--host-chain``): a model's attention layers without the rest of the model.

A stack :class:`~.problems.Problem` has ``layer_windows``: one window per layer (``None``: full causal), gpt-oss's
24 layers alternating W=128 (first) and full. The timed step runs the layers in order, each layer's output the
next layer's query (same shape), every layer with its own fixed K, V and sinks (leaves that take gradients, as a
model's projections would), then one backward from the last output. :class:`StackSystem` wraps any bench
:class:`~.system.System` so: its ``forward`` is the chain of the wrapped system's ``forward`` calls, so the bench's
fwd, bwd, fwd+bwd and host closures (:meth:`System.callables`) time the stack as they time one call.

Gate: the chain's composition is the point of the timing, the kernels' precision is not new, so each distinct
layer (the W=128 one, the full one) is gated as a single-layer problem, on the stack's own tensors of its first
layer of that kind, against the fp64 reference (:func:`.gates.gate`); the row's gate is the weakest of the
layers'. FLOPs and bytes are the sums over the layers (:func:`.problems.flops`).
"""

from __future__ import annotations

import dataclasses

import torch

from .gates import GATES, gate, reference
from . import problems
from .problems import Problem, make_problem_inputs
from .system import System, Unavailable
from .timing import time_row


def layer_problems(prob: Problem) -> list[Problem]:
    """The stack's layers as single-layer problems (each with its own window, ``layer_windows`` None)."""
    if prob.layer_windows is None:
        raise ValueError(f"layer_problems: {prob.label()} is not a stack (layer_windows is None)")
    return [dataclasses.replace(prob, window=w, layer_windows=None) for w in prob.layer_windows]


def _layer_seed(seed: int, i: int) -> int:
    return (seed * 1_000_003 + 7919 * i) % 2**63


def make_stack_inputs(prob: Problem, device, seed: int) -> dict:
    """The first layer's inputs (:func:`.problems.make_problem_inputs`: q, do, cu_seqlens for varlen) and
    ``layers``: per layer a dict of k, v (shaped like the first layer's) and sinks (float32 ``[H]``
    uniform in [-2, 2], as :func:`flashsink.testing.make_inputs`), layer 0's being the first layer's own."""
    layers = layer_problems(prob)
    inp = make_problem_inputs(layers[0], device, seed)
    per = [{"k": inp["k"], "v": inp["v"], "sinks": inp["sinks"]}]
    for i in range(1, len(layers)):
        gen = torch.Generator(device="cpu").manual_seed(_layer_seed(seed, i))

        def randn(like):
            return torch.randn(like.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=like.dtype)

        sinks = torch.rand(prob.heads, generator=gen, dtype=torch.float32) * 4.0 - 2.0
        per.append({"k": randn(inp["k"]), "v": randn(inp["v"]), "sinks": sinks.to(device)})
    inp["layers"] = per
    return inp


def layer_inputs(inp: dict, i: int) -> dict:
    """The single-layer inputs of layer ``i``: the stack's q and do with that layer's k, v, sinks."""
    lay = inp["layers"][i]
    return {k: v for k, v in inp.items() if k != "layers"} | {"k": lay["k"], "v": lay["v"], "sinks": lay["sinks"]}


class StackSystem(System):
    """A bench system run as the stack: ``forward`` chains the wrapped system's ``forward`` over the layers,
    each output the next query. Leaves: q, and each layer's k, v (and sinks for a system with sinks)."""

    def __init__(self, inner: System, prob: Problem):
        self.inner = inner
        self.layers = layer_problems(prob)
        self.name, self.has_sink, self.peer = inner.name, inner.has_sink, inner.peer
        self.note = inner.note
        self.required_gate = inner.required_gate

    def prepare(self, inp: dict, prob: Problem) -> dict:
        """The wrapped system's native-layout copies, layer by layer; only the first layer's q and the last
        layer's do are kept (every layer's q is the previous output; the rest of each layer's preparation,
        e.g. flex's block mask, is kept per layer)."""
        t: dict = {"extras": []}
        last = len(self.layers) - 1
        for i, lp in enumerate(self.layers):
            d = self.inner.prepare(layer_inputs(inp, i), lp)
            if i == 0:
                t["q"] = d["q"]
            if i == last:
                t["do"] = d["do"]
            for n in ("k", "v", "sinks"):
                t[f"{n}{i}"] = d[n]
            t["extras"].append({k: v for k, v in d.items() if k not in ("q", "k", "v", "sinks", "do")})
        return t

    def leaves(self, t: dict) -> list[str]:
        names = ["q"]
        for i in range(len(self.layers)):
            names += [f"k{i}", f"v{i}"] + ([f"sinks{i}"] if self.has_sink else [])
        return names

    def forward(self, t: dict, prob: Problem):
        x = t["q"]
        for i, lp in enumerate(self.layers):
            x = self.inner.forward(dict(t["extras"][i], q=x, k=t[f"k{i}"], v=t[f"v{i}"], sinks=t[f"sinks{i}"]), lp)
        return x

    def release(self) -> None:
        self.inner.release()


def check_stack(system: System, prob: Problem, device: str, opts: dict) -> None:
    """:class:`Unavailable` unless the system runs every distinct layer of the stack. The fp32 reference's
    score budget (``eager_max_gib``) is shared by the layers: the chain's autograd graph keeps them all."""
    opts = dict(opts)
    n = len(prob.layer_windows)
    if "eager_max_gib" in opts:
        opts["eager_max_gib"] = opts["eager_max_gib"] / n
    for lp in dict.fromkeys(layer_problems(prob)):
        try:
            system.check_problem(lp, device, opts)
        except Unavailable as exc:
            msg = str(exc)
            if "eager-max-gib" in msg:
                msg += f" (shared by the stack's {n} layers)"
            raise Unavailable(msg) from None


def _weakest(labels: list[str]) -> str:
    order = [*GATES, "none"]
    return max(labels, key=order.index)


def new_row(prob: Problem, name: str, mode: str, note: str, ceil: dict) -> dict:
    """A row of the stack: the bench's row (:func:`.problems.new_row`, FLOPs and bytes summed over the
    layers), with the layer count and the ratio to FA4's stack."""
    row = problems.new_row(prob, name, mode, note, ceil)
    row.update(layers=len(prob.layer_windows), vs_fa4=None)
    return row


def _window_name(w) -> str:
    return "full" if w is None else f"W={w}"


def run_problem(prob: Problem, systems: list[str], sys_objs: dict, *, modes: list[str], device: str, timer,
                ceil: dict, opts: dict, seed: int, gate2: bool, say, peers: set[str]) -> tuple[list, list]:
    """Rows (per system and mode) and gate records of a stack problem. ``sys_objs``: name -> (system,
    "" or why it is unavailable here); ``peers``: the systems that count for "vs peer"."""
    tag = f"[{prob.label()}]"
    say(f"{tag} {len(prob.layer_windows)} layers, {len(prob.seqlens or ())} documents, {prob.tokens_q} tokens; "
        "inputs ...")
    inp = make_stack_inputs(prob, device, seed)
    layers = layer_problems(prob)
    first = {}  # distinct layer problem -> the index of its first layer
    for i, lp in enumerate(layers):
        first.setdefault(lp, i)
    grads = any(m != "fwd" for m in modes)
    refs: dict = {}

    def ref(lp, sinks: bool):
        key = (lp, sinks)
        if key not in refs:
            li = layer_inputs(inp, first[lp])
            say(f"{tag} reference fp64 of the {_window_name(lp.window)} layer{'' if sinks else ' without sinks'} ...")
            exp = reference(li, lp, sinks=sinks, compute_dtype=torch.float64)
            low = None
            if gate2 and lp.torch_dtype != torch.float64:
                low = reference(li, lp, sinks=sinks, compute_dtype=lp.torch_dtype)
            refs[key] = (exp, low)
        return refs[key]

    rows, gates = [], []
    for name in systems:
        system, status = sys_objs[name]
        if not status:
            try:
                check_stack(system, prob, device, dict(opts, grads=grads))
            except Unavailable as exc:
                status = str(exc) if str(exc).startswith(("n/a", "skipped")) else f"n/a: {exc}"
        results = {}  # layer problem -> GateResult
        if not status:
            for lp, i in first.items():
                exp, low = ref(lp, system.has_sink)
                say(f"{tag} {name}: gate of the {_window_name(lp.window)} layer (first call compiles) ...")
                g = gate(system, lp, layer_inputs(inp, i), exp, low, grads=grads)
                results[lp] = g
                gates.append({"problem": dataclasses.asdict(lp), "stack": prob.label(), "system": name,
                              "layer": _window_name(lp.window), "error": g.error,
                              "reports": [dataclasses.asdict(r) for r in g.reports],
                              "fast_reports": None if g.fast_reports is None
                              else [dataclasses.asdict(r) for r in g.fast_reports]})
        errors = [f"{_window_name(lp.window)} layer: {g.error}" for lp, g in results.items() if g.error]
        calls = stack_sys = None
        for mode in modes:
            row = new_row(prob, name, mode, system.problem_note(layers[0]), ceil)
            rows.append(row)
            if status:
                row["status"] = status
                continue
            if errors:
                row["status"] = "FAIL: " + "; ".join(errors)
                continue
            labels = {lp: g.label(mode) for lp, g in results.items()}
            row["gate"] = _weakest(list(labels.values()))
            fails = []
            for lp, g in results.items():
                stronger = GATES[:GATES.index(labels[lp])] if labels[lp] in GATES else GATES
                fails += [f"{_window_name(lp.window)} {x}: {', '.join(g.failing(mode, x))}" for x in stronger
                          if g.failing(mode, x)]
            row["gate_fails"] = "; ".join(fails)
            need = system.required_gate
            bad = [lp for lp, g in results.items() if need is not None and not g.passes(mode, need)]
            if not bad:
                verdict = "ok"
            elif any(results[lp].fast_reports is None for lp in bad):
                verdict = f"FAIL ({need} gate not run without gate 2; strict): " + "; ".join(
                    f"{_window_name(lp.window)}: {results[lp].reason(mode)}" for lp in bad)
            else:
                verdict = f"FAIL ({need} gate): " + "; ".join(
                    f"{_window_name(lp.window)}: {results[lp].reason(mode, need)}" for lp in bad)
            if calls is None:
                stack_sys = StackSystem(system, prob)
                calls = stack_sys.callables(inp, prob)
            say(f"{tag} {name} {mode}: the {len(layers)}-layer stack, timing ...")
            time_row(row, calls, mode, device, timer, verdict,
                     first_call=lambda sec: say(f"{tag} {name} {mode}: first call {sec:.1f} s"))
        calls = stack_sys = None
        system.release()
        if device == "cuda":
            torch.cuda.empty_cache()
    add_ratios(rows, modes, peers)
    return rows, gates


def add_ratios(rows: list[dict], modes: list[str], peers: set[str]) -> None:
    """Per mode: ``speedup`` = the best peer's ms (among ``peers`` that passed a gate) / this ms, and
    ``vs_fa4`` = fa4's ms / this ms (issue 49's stack target: flashsink >= 1.15x), both in the same run."""
    for mode in modes:
        timed = [r for r in rows if r["mode"] == mode and r["ms"] is not None]
        best = min((r["ms"] for r in timed if r["system"] in peers and r["gate"] in GATES), default=None)
        fa4 = next((r["ms"] for r in timed if r["system"] == "fa4"), None)
        for r in timed:
            r["speedup"] = None if best is None else best / r["ms"]
            r["vs_fa4"] = None if fa4 is None else fa4 / r["ms"]


def stack_summary(result: dict) -> list[str]:
    """One line per stack problem and mode: flashsink's ms against fa4's, the ratio (target >= 1.15x)."""
    out = []
    rows = [r for r in result.get("rows", []) if r.get("kind") == "stack"]
    for prob, mode in dict.fromkeys((r["problem"], r["mode"]) for r in rows):
        rs = {r["system"]: r for r in rows if r["problem"] == prob and r["mode"] == mode}
        fs, fa = rs.get("flashsink", {}), rs.get("fa4", {})

        def ms(r):
            return f"{r['ms']:.3f} ms" if r.get("ms") is not None else (r.get("status") or "not run")[:60]

        ratio = "-" if fs.get("vs_fa4") is None else f"{fs['vs_fa4']:.2f}x"
        flop = next(iter(rs.values()))["flops"]
        out.append(f"stack: {prob} {mode}: flashsink {ms(fs)}, fa4 {ms(fa)}, flashsink vs fa4 {ratio} "
                   f"(target >= 1.15x); {flop / 1e12:.4g} TFLOP a step")
    return out
