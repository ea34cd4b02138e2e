"""The text report: the table of every row, its legend, and the one-line-per-problem summary."""

from __future__ import annotations

from .gates import GATES
from .peers import SYSTEMS
from .problems import FORWARD_ONLY
from .stack import stack_summary


def _f(x, fmt):
    if x is None:
        return "-"
    if fmt.endswith("f") and 0 < abs(x) < 10 and fmt != ".4f":
        return format(x, ".3g")  # CPU smoke runs: small numbers keep their digits
    return format(x, fmt)


def format_table(result: dict) -> str:
    h, c = result["header"], result["ceilings"]
    lines = [
        f"device: {h['device']} | torch {h['torch']} | triton {h['triton']} | tilelang {h['tilelang']} | "
        f"fla {h['fla']} | commit {h['commit']} | {h['date']}"
        + "".join(f" | {name}: {v}" for name, v in h.get("peers", {}).items()),
        f"ceilings (measured in this run): matmul {c['matmul_tflops']:.4g} TFLOP/s ({c['matmul']}); "
        f"copy {c['copy_gbs']:.4g} GB/s ({c['copy']})",
        f"timing: {result['timing']}",
        "",
    ]
    if result.get("interrupted"):
        lines.insert(3, "INTERRUPTED (SIGTERM / Ctrl-C): only the problems finished before it are below")
    cols = [("preset", 12, "<"), ("N", 6, ">"), ("mode", 7, "<"), ("system", 22, "<"), ("gate", 6, "<"),
            ("ms", 9, ">"), ("host us", 8, ">"), ("TFLOP/s", 8, ">"), ("GB/s", 7, ">"), ("floor ms", 9, ">"),
            ("bound", 5, "<"), ("%floor", 6, ">"), ("peak MiB", 9, ">"), ("vs peer", 7, ">")]
    lines.append("  ".join(f"{t:{a}{w}}" for t, w, a in cols) + "  status / note")
    lines.append("-" * (sum(w for _, w, _ in cols) + 2 * len(cols) + 14))
    last, shown = None, set()
    rows = [r for r in result["rows"] if r["status"] != FORWARD_ONLY]  # said once, in the problem's heading
    for r in rows:
        if r["problem"] != last:
            if last is not None:
                lines.append("")
            fwd_only = any(x["problem"] == r["problem"] and x["status"] == FORWARD_ONLY for x in result["rows"])
            lines.append(f"# {r['problem']}" + ("   [forward only: bwd, fwd+bwd n/a]" if fwd_only else ""))
        last = r["problem"]
        untimed = r["ms"] is None and not r["status"].startswith("FAIL")
        if untimed:  # unavailable / n/a / skipped: one row for the modes that share the status
            key = (r["problem"], r["system"], r["status"])
            if key in shown:
                continue
            shown.add(key)
            same = [x["mode"] for x in rows if (x["problem"], x["system"], x["status"]) == key]
            every = {x["mode"] for x in rows if x["problem"] == r["problem"]}
            r = dict(r, mode="all" if len(same) > 1 and set(same) == every else ",".join(same),
                     floor_ms=None, bound="")
        vals = (r["preset"], str(r["N"]), r["mode"], r["system"], r.get("gate") or "-", _f(r["ms"], ".4f"),
                _f(r.get("host_us"), ".1f"), _f(r["tflops"], ".1f"), _f(r["gbs"], ".0f"), _f(r["floor_ms"], ".4f"),
                r["bound"], _f(r["pct_floor"], ".1f"), _f(r["peak_mib"], ".0f"),
                "-" if r["speedup"] is None else f"{r['speedup']:.2f}x")
        status = r["status"]
        if r.get("tokens_s"):
            status += f", {r['tokens_s']:,.0f} tokens/s"
        if r.get("gate_fails"):
            status += f" (fails {r['gate_fails']})"
        default_note = getattr(SYSTEMS.get(r["system"]), "note", "")
        if r["note"] and r["note"] != default_note:  # default notes are in the legend below
            status += f" ({r['note']})"
        lines.append("  ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, cols)) + "  " + status)
    lines += [
        "",
        "TFLOP/s over visible (q,k) pairs: fwd 4*pairs*D, bwd 10*pairs*D, fwd+bwd 14*pairs*D. GB/s over the "
        "fewest bytes (q,k,v[,do] read once; o[,dq,dk,dv] written once). floor = max(FLOPs/matmul ceiling, "
        "bytes/copy ceiling); %floor = floor/ms. peak MiB: max allocated over the inputs during one call. "
        "vs peer: best peer with sinks (fa4, cudnn, flex, fla) passing a gate, ms / this ms (>1 = faster). gate: the "
        "strongest precision gate passed in this mode (strict: the precision standard; fast: rel L2 <= 1.5x "
        "torch's in the input dtype; none), every system is timed whatever it passes; flashsink must pass its "
        "own precision's gate, else FAIL. host us: enqueue time per call, 20 calls without a sync after "
        "warm-up (fwd+bwd: o = f(...); o.backward(do)). sdpa has no sink (judged against the no-sink reference).",
        *(["varlen: N = total tokens; pairs and bytes summed over the packed sequences (each masked within "
           "itself); the gate runs the reference per sequence."] if any(r.get("kind") == "varlen" for r in rows)
          else []),
        *(["decode: N = KV-cache length, one query row per sequence; bound by bytes, so %floor is the share of "
           "the copy ceiling reached (GB/s over the copy GB/s)."] if any(r.get("kind") == "decode" for r in rows)
          else []),
        *(["hf-train: N = tokens of one GptOssForCausalLM training step (zero_grad, loss, backward); ms per step, "
           "peak MiB = torch.cuda.max_memory_allocated over the step (weights and gradients included), vs peer = "
           "hf/flex_attention ms / this ms; gate judges the logits on a short sequence (fp64 model as expected, "
           "eager in the bench dtype as lowp)."] if any(r.get("kind") == "hf-train" for r in rows) else []),
    ]
    if any(r.get("kind") == "stack" for r in rows):
        lines.append("stack: N = total tokens; one step = the layers in order, each layer's output the next one's "
                     "query, each with its own K, V, sinks, then one backward from the last output; FLOPs and bytes "
                     "summed over the layers; gate: the weakest of its distinct layers' gates (each gated alone).")
    legend = [f"{n} = {getattr(SYSTEMS[n], 'note', '') or n}"
              for n in dict.fromkeys(r["system"] for r in result["rows"]) if n in SYSTEMS]
    if legend:
        lines.append("systems: " + "; ".join(legend))
    for p in result["profiles"]:
        lines += ["", f"profile: flashsink fwd+bwd, {p['problem']} (per iteration, torch.profiler CUDA)",
                  f"{'kernel':<60} {'role':<28} {'calls':>5} {'us':>9} {'share':>6}"]
        for k in p["kernels"]:
            lines.append(f"{k['kernel'][:60]:<60} {k['role']:<28} {k['calls_per_iter']:5.1f} "
                         f"{k['us_per_iter']:9.1f} {k['share']:5.1f}%")
    lines += ["", summary(result)]
    lines += stack_summary(result)
    return "\n".join(lines)


def summary(result: dict) -> str:
    """One line per (problem, mode): flashsink (fast) against the best peer with sinks that passes a
    gate (its gate in brackets), FA4 and FLA (the peers the varlen and causal targets name) and SDPA; "strict ms" is
    flashsink-strict, "det ms" flashsink-det (deterministic=True), "graph ms" flashsink replayed from a CUDA graph
    (its kernels without the host's time), "host us" flashsink's host time."""
    rows = [r for r in result["rows"] if r["status"] != FORWARD_ONLY]
    keys = list(dict.fromkeys((r["problem"], r["mode"]) for r in rows))
    wp = max([len("problem")] + [len(p) for p, _ in keys])
    out = [f"summary: {'problem':<{wp}} {'mode':<7} {'flashsink ms':>12} {'TFLOP/s':>8} {'GB/s':>6} {'%floor':>6}  "
           f"{'best peer':<25} {'vs peer':>7}  {'fa4 ms':>9}  {'fla ms':>9}  {'sdpa(no sink) ms':>16}  "
           f"{'strict ms':>9}  {'det ms':>9}  {'graph ms':>9}  {'host us':>7}"]
    for prob, mode in keys:
        rs = {r["system"]: r for r in rows if r["problem"] == prob and r["mode"] == mode}
        fs = rs.get("flashsink") or rs.get("hf/flashsink", {})  # hf-train: the model step, against flex
        peers = [r for r in rs.values() if r["ms"] is not None and r.get("gate") in GATES
                 and (getattr(SYSTEMS.get(r["system"]), "peer", False) or r["system"] == "hf/flex_attention")]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        fs_ms = fs.get("ms")
        fs_txt = _f(fs_ms, ".4f") if fs_ms is not None else (fs.get("status", "-")[:12] or "-")
        peer_txt = f"{best['system']} {best['ms']:.4f} [{best['gate']}]" if best else "none timed"
        out.append(
            f"         {prob:<{wp}} {mode:<7} {fs_txt:>12} {_f(fs.get('tflops'), '.1f'):>8} "
            f"{_f(fs.get('gbs'), '.0f'):>6} {_f(fs.get('pct_floor'), '.1f'):>6}  "
            f"{peer_txt:<25} "
            f"{'-' if fs.get('speedup') is None else format(fs['speedup'], '.2f') + 'x':>7}  "
            f"{_f(rs.get('fa4', {}).get('ms'), '.4f'):>9}  {_f(rs.get('fla', {}).get('ms'), '.4f'):>9}  "
            f"{_f(rs.get('sdpa', {}).get('ms'), '.4f'):>16}  {_f(rs.get('flashsink-strict', {}).get('ms'), '.4f'):>9}  "
            f"{_f(rs.get('flashsink-det', {}).get('ms'), '.4f'):>9}  "
            f"{_f(rs.get('flashsink-graph', {}).get('ms'), '.4f'):>9}  {_f(fs.get('host_us'), '.1f'):>7}"
        )
    return "\n".join(out)
