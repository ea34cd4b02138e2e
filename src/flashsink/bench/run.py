"""The run: gate, then time, every (problem, system, mode), with the header that says where and
on what it ran."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from .gates import GATES, gate, reference
from .kernel_profile import profile_flashsink
from .peers import SYSTEMS
from .problems import FORWARD_ONLY, VARLEN_SEED, Problem, lengths_summary, make_problem_inputs, new_row
from .system import Unavailable, callables_of
from .timing import Timer, measure_ceilings, time_row


def _commit() -> str:
    env = os.environ.get("FLASHSINK_COMMIT")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip()[:12] + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return "unknown (no .git; set FLASHSINK_COMMIT)"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except Exception:  # noqa: BLE001
        mod = sys.modules.get(pkg)
        return getattr(mod, "__version__", "not installed")


def header(device: str) -> dict:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run; not a performance number)"
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "tilelang": _version("tilelang"),
        "fla": _version("fla-core"),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



def run_bench(problems: list[Problem], *, systems: list[str], modes: list[str], device: str,
              timer: Timer | None = None, opts: dict | None = None, profile: bool = False,
              gate2: bool = True, seed: int = 0, result: dict | None = None,
              on_problem=None) -> dict:
    """Gate, then time, every (problem, system, mode). Returns the JSON-ready result; pass
    ``result`` (a dict, filled in place) to keep the rows done so far if the run is cut short.
    ``on_problem(result)`` is called after each problem."""
    opts = dict(opts or {})
    timer = timer or Timer(device)
    result = {} if result is None else result
    result.update({"header": header(device), "timing": timer.method, "rows": [], "profiles": [], "gates": []})
    say(f"bench on {result['header']['device']}; measuring the ceilings ...")
    ceil = measure_ceilings(device, timer)
    result["ceilings"] = ceil
    say(f"  matmul {ceil['matmul_tflops']:.4g} TFLOP/s ({ceil['matmul']}), copy {ceil['copy_gbs']:.4g} GB/s")

    sys_objs = {}
    for name in systems:
        obj = SYSTEMS[name]()
        try:
            obj.check_available(device)
            sys_objs[name] = (obj, "")
        except Unavailable as exc:
            sys_objs[name] = (obj, f"unavailable: {exc}")
        if not sys_objs[name][1] and getattr(obj, "version", ""):  # a peer's library versions (cudnn)
            result["header"].setdefault("peers", {})[name] = obj.version

    for prob in problems:
        tag = f"[{prob.label()}]"
        if prob.hf_train:  # a model's training step, not one attention call: its own runner
            from . import hf as bench_hf

            rows, gates = bench_hf.run_problem(prob, systems, device, timer, seed, tiny=prob.seq_q < 1024, say=say,
                                               timed="fwd+bwd" in modes)
            result["rows"].extend(rows)
            result["gates"].extend(gates)
            if on_problem is not None:
                on_problem(result)
            continue
        if prob.layer_windows is not None:  # the attention stack: a chain of layers, its own runner
            from . import stack as bench_stack

            rows, gates = bench_stack.run_problem(
                prob, systems, sys_objs, modes=modes, device=device, timer=timer, ceil=ceil, opts=opts, seed=seed,
                gate2=gate2, say=say, peers={n for n in systems if SYSTEMS[n].peer})
            result["rows"].extend(rows)
            result["gates"].extend(gates)
            if on_problem is not None:
                on_problem(result)
            continue
        # decode is forward only: no backward in its gate, and its other modes are n/a
        grads = any(m != "fwd" for m in modes) and not prob.forward_only
        if prob.seqlens is not None:
            say(f"{tag} {len(prob.seqlens)} sequences (seed {VARLEN_SEED}), lengths min/median/max "
                 f"{lengths_summary(prob.seqlens)}, {prob.tokens_q} tokens")
        inp = make_problem_inputs(prob, device, seed)
        refs = {}

        def ref(sinks: bool):
            if sinks not in refs:
                what = "with sinks" if sinks else "without sinks (for sdpa)"
                say(f"{tag} reference fp64 {what} ...")
                exp = reference(inp, prob, sinks=sinks, compute_dtype=torch.float64)
                low = None
                if gate2 and prob.torch_dtype != torch.float64:
                    say(f"{tag} reference {prob.dtype} {what} (gate 2) ...")
                    low = reference(inp, prob, sinks=sinks, compute_dtype=prob.torch_dtype)
                refs[sinks] = (exp, low)
            return refs[sinks]

        prob_rows = []
        for name in systems:
            system, unavailable = sys_objs[name]
            note = system.problem_note(prob)
            status = unavailable
            if not status:
                try:
                    system.check_problem(prob, device, dict(opts, grads=grads))
                except Unavailable as exc:
                    status = str(exc) if str(exc).startswith(("n/a", "skipped")) else f"n/a: {exc}"
            g = None
            if not status:
                exp, low = ref(system.has_sink)
                say(f"{tag} {name}: correctness gate (first call compiles) ...")
                t0 = time.perf_counter()
                g = gate(system, prob, inp, exp, low, grads=grads)
                labels = {m: g.label(m) for m in modes if not (prob.forward_only and m != "fwd")}
                say(f"{tag} {name}: gate {'raised' if g.error else labels} in {time.perf_counter() - t0:.1f} s")

                def dump(reports):
                    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(r).items()}
                            for r in reports]

                result["gates"].append({
                    "problem": asdict(prob), "system": name, "error": g.error, "reports": dump(g.reports),
                    "fast_reports": None if g.fast_reports is None else dump(g.fast_reports),
                })
            calls = None
            for mode in modes:
                row = new_row(prob, name, mode, note, ceil)
                if prob.forward_only and mode != "fwd":
                    row["status"] = FORWARD_ONLY
                elif status:
                    row["status"] = status
                elif g.error:
                    row["status"] = "FAIL: " + g.error
                else:
                    # timed whatever gate it passes: the row says which, so speed and precision stand
                    # side by side; flashsink must pass its own precision's gate
                    row["gate"] = g.label(mode)
                    stronger = GATES[:GATES.index(row["gate"])] if row["gate"] in GATES else GATES
                    row["gate_fails"] = "; ".join(f"{x}: {', '.join(g.failing(mode, x))}" for x in stronger
                                                  if g.failing(mode, x))
                    need = system.required_gate
                    if need is None or g.passes(mode, need):
                        verdict = "ok"
                    elif g.fast_reports is None:  # --no-gate2: no lowp, so no fast gate; judged by gate 1
                        verdict = f"FAIL ({need} gate not run without gate 2; strict): " + g.reason(mode)
                    else:
                        verdict = f"FAIL ({need} gate): " + g.reason(mode, need)
                    if calls is None:
                        calls, state = callables_of(system, prob, inp)
                    say(f"{tag} {name} {mode}: timing ...")
                    time_row(row, calls, mode, device, timer, verdict)
                prob_rows.append(row)
            calls = state = None
            system.release()
            if profile and name == "flashsink" and device == "cuda" and g is not None and not g.error:
                say(f"{tag} flashsink: profiling one fwd+bwd ...")
                result["profiles"].append({"problem": prob.label(), "kernels": profile_flashsink(prob, inp)})
        # speedup over the best peer with sinks that passes a gate, per mode
        for mode in modes:
            peers = [r["ms"] for r in prob_rows if r["mode"] == mode and r["ms"] is not None
                     and SYSTEMS[r["system"]].peer and r["gate"] in GATES]
            best = min(peers) if peers else None
            for r in prob_rows:
                if r["mode"] == mode and r["ms"] is not None and best is not None:
                    r["speedup"] = best / r["ms"]
            result.setdefault("best_peer_ms", {})[f"{prob.label()} {mode}"] = best
        result["rows"].extend(prob_rows)
        if on_problem is not None:
            on_problem(result)
        del inp, refs
        if device == "cuda":
            torch.cuda.empty_cache()
    return result
