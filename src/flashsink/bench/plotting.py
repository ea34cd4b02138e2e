"""``--plot``: a PNG of TFLOP/s (GB/s for decode) per preset and mode."""

from __future__ import annotations

from .problems import FORWARD_ONLY


def plot_title(result: dict) -> str:
    """The PNG's title: device, commit, date of one run, or of each run of a merged result
    (tools/bench_merge.py: ``{"runs": [{"header": ...}, ...], "rows": ...}``)."""
    headers = [result["header"]] if "header" in result else [r["header"] for r in result.get("runs", [])]
    devices = sorted({h["device"] for h in headers})
    commits = sorted({str(h["commit"])[:12] for h in headers})
    dates = sorted(h["date"] for h in headers)
    when = dates[0] if len(dates) < 2 or dates[0] == dates[-1] else f"{dates[0]} .. {dates[-1]}"
    return f"flashsink bench - {', '.join(devices)} - {', '.join(commits)} - {when}"


def plot(result: dict, path: str) -> str | None:
    """PNG: per preset and mode, TFLOP/s vs N (sweeps) or bars (single length). None if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"--plot: matplotlib is not importable ({exc}); no plot written"
    rows = [r for r in result["rows"] if r["tflops"] is not None]
    presets = list(dict.fromkeys(r["preset"] for r in result["rows"]))
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    systems = list(dict.fromkeys(r["system"] for r in result["rows"]))
    fig, axes = plt.subplots(len(presets), len(modes), figsize=(5 * len(modes), 3.6 * len(presets)), squeeze=False)
    for i, pr in enumerate(presets):
        pr_rows = [r for r in result["rows"] if r["preset"] == pr]
        # decode is bound by bytes: GB/s says more than TFLOP/s there
        key, unit = ("gbs", "GB/s") if any(r.get("kind") == "decode" for r in pr_rows) else \
            ("tflops", "TFLOP/s (visible pairs)")
        ns = sorted({r["N"] for r in pr_rows})
        variants = len({r["problem"] for r in pr_rows}) > len(ns)  # e.g. varlen: window 128 and full causal
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            sel = [r for r in rows if r["preset"] == pr and r["mode"] == mode]
            if not sel:
                fwd_only = any(r["mode"] == mode and r["status"] == FORWARD_ONLY for r in pr_rows)
                ax.text(0.5, 0.5, FORWARD_ONLY if fwd_only else "nothing timed (n/a, unavailable or FAIL)",
                        ha="center", va="center", transform=ax.transAxes, fontsize=8)
            elif len(ns) > 1:
                for s in systems:
                    pts = sorted((r["N"], r[key]) for r in sel if r["system"] == s)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("KV-cache length" if key == "gbs" else "N")
                ax.legend(fontsize=8)
            else:
                def tag(r):
                    if not variants:
                        return r["system"]
                    return f"{r['system']}\n{'full' if r.get('window') is None else 'W=' + str(r['window'])}"

                names = [tag(r) for r in sel]
                vals = [r[key] for r in sel]
                ax.bar(range(len(names)), vals, color=[f"C{systems.index(r['system'])}" for r in sel])
                ax.set_xticks(range(len(names)), names, fontsize=7 if variants else None)
                for x, v in enumerate(vals):
                    ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{pr} {mode}")
            ax.set_ylabel(unit)
    fig.suptitle(plot_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
