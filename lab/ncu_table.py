"""Issue 55's ncu table from ncu's CSV (``ncu --csv --metrics ...`` output, one file per run):

    python lab/ncu_table.py LABEL=FILE.csv [LABEL=FILE.csv ...]

One row per profiled kernel: time (ms), DRAM read / write (GB), L2 hit rate, instructions (M), grid, registers
and, where the metric was asked for, the tensor pipe's busy share. ``LABEL`` names the run (the system and the
shape); a kernel's name is shortened to what tells kernels apart (FA4's CuTe names are long)."""

import csv
import re
import sys

COLS = [("gpu__time_duration.sum", "ms", 1e-6), ("dram__bytes_read.sum", "DRAM rd GB", 1e-9),
        ("dram__bytes_write.sum", "DRAM wr GB", 1e-9), ("lts__t_sector_hit_rate.pct", "L2 hit %", 1),
        ("smsp__inst_executed.sum", "inst M", 1e-6), ("launch__grid_size", "grid", 1),
        ("launch__registers_per_thread", "regs", 1),
        ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed", "gmma %", 1)]
#: the units ncu may print, to the base unit the columns scale from (ns, bytes, count)
UNITS = {"ns": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "nsecond": 1, "s": 1e9, "second": 1e9,
         "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6, "GB": 1e9,
         "%": 1, "inst": 1, "Kinst": 1e3, "Minst": 1e6, "Ginst": 1e9, "": 1, "block": 1, "register/thread": 1,
         "cycle": 1}


def short(name: str) -> str:
    m = re.search(r"(FlashAttention\w*?)(Sm\d+)?_", name)
    if m:
        return m.group(1)
    return name.split("(")[0][:48]


def rows(path: str) -> list:
    """``[(kernel, {metric: value in base units})]`` in launch order."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own log lines are not CSV
    kernels: dict = {}
    for r in csv.DictReader(lines):
        k = kernels.setdefault(r["ID"], (r["Kernel Name"], {}))
        val = r["Metric Value"].replace(",", "")
        try:
            k[1][r["Metric Name"]] = float(val) * UNITS.get(r.get("Metric Unit", ""), 1)
        except ValueError:
            continue
    return [kernels[i] for i in sorted(kernels, key=int)]


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    head = ["run", "kernel"] + [c[1] for c in COLS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        try:
            found = rows(path)
        except (OSError, KeyError) as exc:
            print(f"| {label} | unreadable: {type(exc).__name__}: {exc} |")
            continue
        for name, m in found:
            cells = [f"{m[k] * s:.4g}" if k in m else "-" for k, _, s in COLS]
            print(f"| {label} | {short(name)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
