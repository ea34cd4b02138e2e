"""Merge `flashsink bench --json` files written by several runs (one device call may not hold
every preset): each run's own table (its ceilings and header), then one summary and one plot
over all rows. Ratios stay within a run: every problem's systems are timed in the same run.

    python tools/bench_merge.py --plot bench.png run1.json run2.json
"""

import argparse
import json

from flashsink import bench

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    p.add_argument("--json", default=None, help="write the merged rows here")
    args = p.parse_args()
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    for path, run in zip(args.files, runs):
        print(f"==== {path}")
        print(bench.format_table(run))
        print()
    merged = {"runs": [{"header": r["header"], "ceilings": r["ceilings"]} for r in runs],
              "rows": [row for r in runs for row in r["rows"]],
              "profiles": [pr for r in runs for pr in r.get("profiles", [])]}
    print(bench.summary(merged))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=1)
    if args.plot:
        print(bench.plot(merged, args.plot) or f"wrote {args.plot}")
