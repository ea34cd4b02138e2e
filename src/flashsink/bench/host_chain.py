"""``flashsink bench --host-chain``: the host's cost per layer of a model's attention chain.

A model does not call attention once and wait: it issues its layers one after the other while the GPU runs
behind. This mode times that issue on the host. The chain is the stack of :mod:`.stack` on the dense gpt-oss
layer shape (``B=1 N=4096 H=64 Hkv=8 D=64`` bf16, 24 layers alternating W=128 and full causal; SDPA has no
varlen): each layer's output the next one's query, then one ``backward()`` from the last output. One backward
a chain spreads the autograd engine's fixed cost per ``backward()`` (~95 us) over the 24 layers, as a model does.

Each repeat: the GPU is held busy first (``torch.cuda._sleep``, a spin of a calibrated number of cycles,
followed by an event), so every launch of the chain only queues; then ``perf_counter`` times the issue of the
forward chain and the backward; then the event is queried. If the GPU had already finished its busy work when
the host finished issuing (the event complete), the host may have waited on the GPU (a synchronizing call in
the chain, or a sleep too short): that repeat is invalid, the sleep is lengthened (x4) and the repeat retried,
up to :data:`MAX_LENGTHEN` times; past that the row is reported invalid. The result is the median over
``reps`` valid repeats (after ``warmup`` unheld ones, which take the first calls' compiles), per layer.

Rows: flashsink (``flashsink.attention``, with sinks), fa4 (``flash_attn_func``, with sinks) and sdpa
(``F.scaled_dot_product_attention``, no sinks, ``is_causal=True`` on every layer: its windowed form would be a
dense mask). The ratio is each system's us/layer over sdpa's (target 5 of issue 49: flashsink <= 1.00).

The pieces are injectable (``busy``: hold / finished / sync, ``clock``), so the arithmetic and the invalid flag
are tested on the CPU; the command itself needs CUDA.
"""

from __future__ import annotations

import statistics
import time

import torch

from .problems import STACK_LAYERS, Problem
from .stack import StackSystem, make_stack_inputs
from .system import Unavailable

SYSTEMS = ("flashsink", "fa4", "sdpa")
SHAPE = dict(batch=1, heads=64, kv_heads=8, seq=4096, head_dim=64, window=128)
WARMUP = 3
REPS = 20
MIN_SLEEP_MS = 50.0  # the first hold, at least
SLEEP_FACTOR = 4.0  # ... and at least this many times one unheld chain's host time
LENGTHEN = 4.0
MAX_LENGTHEN = 4  # tries with a longer hold before a row is invalid
MAX_SLEEP_MS = 20_000.0
NO_CUDA_MESSAGE = ("error: --host-chain needs a CUDA GPU (it holds the GPU busy with torch.cuda._sleep so the "
                   "chain's launches only queue, and times their issue); there is no CPU version of it")


def chain_problem(dtype: str = "bf16", *, sinks: bool = True, shape: dict | None = None,
                  layers: int = STACK_LAYERS) -> Problem:
    """The dense gpt-oss chain (``shape``: :data:`SHAPE` unless given, for the tests): ``layers`` layers
    alternating W (first) and full causal; ``sinks=False`` (sdpa): every layer full causal (SDPA's window
    would be a dense mask, other work)."""
    s = SHAPE if shape is None else shape
    if layers < 1:
        raise ValueError(f"chain_problem: layers must be >= 1, got {layers}")
    layers = tuple(s["window"] if sinks and i % 2 == 0 else None for i in range(layers))
    return Problem("host-chain", s["batch"], s["heads"], s["kv_heads"], s["seq"], s["seq"], s["head_dim"],
                   s["window"] if sinks else None, dtype, layer_windows=layers)


class CudaBusy:
    """Holds the current CUDA stream busy: ``hold(ms)`` queues ``torch.cuda._sleep`` of about ``ms`` (cycles
    calibrated once with CUDA events) and an event after it; ``finished(event)``: has the GPU got past it."""

    def __init__(self, calib_cycles: int = 10_000_000):
        torch.cuda.synchronize()
        torch.cuda._sleep(calib_cycles // 10)  # first call out of the calibration
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(calib_cycles)
        e.record()
        torch.cuda.synchronize()
        self.cycles_per_ms = calib_cycles / max(s.elapsed_time(e), 1e-3)

    def hold(self, ms: float):
        torch.cuda._sleep(int(ms * self.cycles_per_ms))
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def finished(self, handle) -> bool:
        return bool(handle.query())

    def sync(self) -> None:
        torch.cuda.synchronize()


def measure(step, busy, *, layers: int, reps: int = REPS, warmup: int = WARMUP, reset=None,
            clock=time.perf_counter, say=None) -> dict:
    """Host time of ``step()`` (one chain: forward over ``layers`` layers and one backward) while ``busy``
    holds the GPU: median over ``reps`` valid repeats, in us per chain and per layer. ``reset()`` (e.g. the
    leaves' grads to None) runs before each repeat, outside the timing. Returns the numbers, the hold used,
    the invalid repeats and ``valid`` (False, with ``reason``, when the hold could not cover the issue)."""
    if reps < 1 or warmup < 0 or layers < 1:
        raise ValueError(f"measure: need reps >= 1, warmup >= 0, layers >= 1; got reps={reps}, warmup={warmup}, "
                         f"layers={layers}")
    reset = reset or (lambda: None)
    for _ in range(warmup):
        reset()
        step()
        busy.sync()
    reset()
    busy.sync()
    t0 = clock()
    step()
    unheld_ms = (clock() - t0) * 1e3
    busy.sync()
    sleep_ms = min(MAX_SLEEP_MS, max(MIN_SLEEP_MS, SLEEP_FACTOR * unheld_ms))
    samples, invalid, lengthened = [], 0, 0
    while len(samples) < reps:
        reset()
        busy.sync()
        handle = busy.hold(sleep_ms)
        t0 = clock()
        step()
        t1 = clock()
        early = busy.finished(handle)
        busy.sync()
        if early:  # the GPU went idle before the host was done: the host may have waited on it
            invalid += 1
            if lengthened >= MAX_LENGTHEN or sleep_ms >= MAX_SLEEP_MS:
                return {"valid": False, "us_chain": None, "us_per_layer": None, "reps": len(samples),
                        "invalid_reps": invalid, "sleep_ms": sleep_ms, "unheld_ms": unheld_ms,
                        "reason": f"the GPU finished its {sleep_ms:.0f} ms of busy work before the host finished "
                                  f"issuing, {invalid} times (lengthened {lengthened}x): the chain waits on the "
                                  "GPU (a synchronizing call) or issues for longer than the hold"}
            lengthened += 1
            sleep_ms = min(MAX_SLEEP_MS, sleep_ms * LENGTHEN)
            if say:
                say(f"  the GPU caught up with the host: repeat invalid, hold lengthened to {sleep_ms:.0f} ms")
            samples = []  # every kept repeat under the same hold
            continue
        samples.append(t1 - t0)
    med = statistics.median(samples)
    return {"valid": True, "us_chain": med * 1e6, "us_per_layer": med * 1e6 / layers, "reps": reps,
            "invalid_reps": invalid, "sleep_ms": sleep_ms, "unheld_ms": unheld_ms, "reason": "",
            "min_us_per_layer": min(samples) * 1e6 / layers}


def chain_step(system, prob: Problem, inp: dict):
    """(step, reset): ``step`` runs the chain's forward and one ``backward()`` from its last output (the
    output gradient given); ``reset`` sets the leaves' grads to None (zero_grad(set_to_none=True))."""
    st = StackSystem(system, prob)
    t = st.prepare(inp, prob)
    names = st.leaves(t)
    for n in names:
        t[n] = t[n].detach().clone().requires_grad_(True)
    leaves = [t[n] for n in names]
    do = t["do"].to(prob.torch_dtype)

    def step():
        o = st.forward(t, prob)
        o.backward(do)

    def reset():
        for x in leaves:
            x.grad = None

    return step, reset


def add_ratios(rows: list[dict]) -> None:
    """``ratio_to_sdpa``: this row's us/layer over sdpa's (both valid), in the same run."""
    sdpa = next((r["us_per_layer"] for r in rows if r["system"] == "sdpa" and r.get("valid")), None)
    for r in rows:
        r["ratio_to_sdpa"] = (r["us_per_layer"] / sdpa) if (sdpa and r.get("valid")) else None


def run_host_chain(systems: list[str], *, device: str, dtype: str = "bf16", reps: int = REPS, warmup: int = WARMUP,
                   seed: int = 0, say, busy=None, registry=None, clock=time.perf_counter, shape: dict | None = None,
                   layers: int = STACK_LAYERS) -> dict:
    """Rows of the host-chain mode for ``systems`` (of :data:`SYSTEMS`): per system its us per layer (or the
    reason it was not measured) and the ratio to sdpa. ``busy``, ``registry`` (name -> System class) and
    ``clock``, ``shape`` and ``layers`` are injectable for the tests; on CUDA ``busy`` defaults to
    :class:`CudaBusy`."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"--systems with --host-chain: choose from {', '.join(SYSTEMS)}, got {bad or systems}")
    if registry is None:
        from .peers import SYSTEMS as registry
    if busy is None:
        if device != "cuda":
            raise ValueError(NO_CUDA_MESSAGE)
        busy = CudaBusy()
    rows = []
    inputs: dict = {}
    for name in systems:
        system = registry[name]()
        prob = chain_problem(dtype, sinks=system.has_sink, shape=shape, layers=layers)
        row = {"system": name, "problem": prob.label(), "layers": len(prob.layer_windows), "valid": False,
               "us_per_layer": None, "us_chain": None, "ratio_to_sdpa": None, "reps": 0, "invalid_reps": 0,
               "sleep_ms": None, "unheld_ms": None, "status": "", "note": "" if system.has_sink else "no sink"}
        rows.append(row)
        try:
            system.check_available(device)
            for lp in dict.fromkeys(StackSystem(system, prob).layers):
                system.check_problem(lp, device, {"grads": True})
        except Unavailable as exc:
            row["status"] = str(exc) if str(exc).startswith(("n/a", "unavailable")) else f"unavailable: {exc}"
            continue
        if prob not in inputs:
            inputs[prob] = make_stack_inputs(prob, device, seed)
        try:
            step, reset = chain_step(system, prob, inputs[prob])
            say(f"host-chain {name}: {row['layers']} layers + one backward, warm-up (first calls compile) ...")
            t0 = time.perf_counter()
            reset()
            step()
            busy.sync()
            say(f"host-chain {name}: first chain {time.perf_counter() - t0:.1f} s; {reps} held repeats ...")
            m = measure(step, busy, layers=row["layers"], reps=reps, warmup=warmup, reset=reset, clock=clock, say=say)
        except Exception as exc:  # noqa: BLE001
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        finally:
            system.release()
        row.update(m)
        row["status"] = "ok" if m["valid"] else "INVALID: " + m["reason"]
    add_ratios(rows)
    return {"mode": "host-chain", "rows": rows,
            "timing": f"host perf_counter over the issue of the chain with the GPU held busy; median of {reps} "
                      f"repeats after {warmup} warm-up chains"}


def format_host_chain(result: dict) -> str:
    """The short table: us per layer, us per chain, ratio to sdpa, hold, status."""
    h = result.get("header", {})
    lines = []
    if h:
        lines += [f"device: {h.get('device')} | torch {h.get('torch')} | commit {h.get('commit')} | {h.get('date')}"]
    lines += [f"timing: {result['timing']}"]
    rows = result["rows"]
    if rows:
        lines.append(f"# {rows[0]['problem']}")
    lines.append(f"{'system':<10} {'us/layer':>9} {'us/chain':>10} {'/ sdpa':>7} {'hold ms':>8} {'invalid':>7}  status")
    for r in rows:
        us = "-" if r["us_per_layer"] is None else f"{r['us_per_layer']:.1f}"
        ch = "-" if r["us_chain"] is None else f"{r['us_chain']:.0f}"
        ra = "-" if r["ratio_to_sdpa"] is None else f"{r['ratio_to_sdpa']:.2f}"
        sl = "-" if r["sleep_ms"] is None else f"{r['sleep_ms']:.0f}"
        st = r["status"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"{r['system']:<10} {us:>9} {ch:>10} {ra:>7} {sl:>8} {r['invalid_reps']:>7}  {st}")
    lines.append("us/layer: host time (perf_counter) to issue the forward chain and one backward(), per layer, with "
                 "the GPU held busy so launches only queue; / sdpa: this us/layer over sdpa's (issue 49 target 5: "
                 "flashsink <= 1.00). sdpa: no sink, is_causal on every layer. A repeat whose hold the GPU finished "
                 "before the host finished issuing is invalid and retried under a longer hold.")
    return "\n".join(lines)


# flags of the attention-call bench that mean nothing in this mode: (dest, flag)
_OTHER_FLAGS = (("preset", "--preset"), ("shape", "--shape"), ("seq", "--seq"), ("mode", "--mode"),
                ("plot", "--plot"), ("profile", "--profile"), ("no_causal", "--no-causal"))


def cmd_host_chain(args, *, cuda_available=None, check_output_path=None) -> int:
    """``flashsink bench --host-chain``: usage errors and the CUDA check (exit 2, one line, before any
    work), then the rows, the table, ``--json``."""
    import json
    import sys

    from .run import say, header

    def usage(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    given = [flag for dest, flag in _OTHER_FLAGS if getattr(args, dest, None)]
    if given:
        return usage(f"--host-chain times its own fixed chain; drop {', '.join(given)}")
    reps = REPS if args.chain_reps is None else args.chain_reps
    if reps < 1:
        return usage(f"--chain-reps must be >= 1, got {reps}")
    systems = [s.strip() for s in (args.systems or "").split(",") if s.strip()] or list(SYSTEMS)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        return usage(f"--systems with --host-chain: choose from {', '.join(SYSTEMS)}, got {bad}")
    if check_output_path is not None:
        try:
            check_output_path("--json", args.json)
        except ValueError as exc:
            return usage(str(exc))
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if args.device == "cpu" or not has_cuda:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    dtype = args.dtype or "bf16"
    say(f"host-chain on {torch.cuda.get_device_name()}: {', '.join(systems)}, {reps} repeats; "
         "calibrating the busy hold ...")
    result = {"header": header("cuda")}
    result.update(run_host_chain(systems, device="cuda", dtype=dtype, reps=reps, seed=args.seed,
                                 say=say))
    print(format_host_chain(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        say(f"wrote {args.json}")
    return 0 if all(r["valid"] or not r["status"].startswith("INVALID") for r in result["rows"]) else 1
