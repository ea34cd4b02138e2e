"""Precompile, in parallel, every kernel configuration a test run recorded with
FLASHSINK_RECORD_KERNELS (one JSON object per line: kind and KernelConfig fields).

    python tools/precompile_recorded.py recorded.jsonl
"""

import json
import sys


def recorded_pairs(path: str) -> list:
    """(kind, config) of each recorded kernel, and with a recorded forward the rest of its
    configuration's forward and backward (a test that records the forward may stop before its
    backward); not the kinds of a configuration seen only through a lone kernel (merge_splits' float32
    partials are no fwd's dtype). A forward kind since removed (an older run's) is read as ``fwd``;
    ``fwd_window`` (removed in docs/perf-log.md v15, back in v19) is a forward like ``fwd``."""
    from flashsink.kernel_config import KernelConfig
    from flashsink.ops.compiler.kinds import KINDS
    from flashsink.ops.compiler.precompile import kinds_for

    recorded = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                kind = d.pop("kind")
                if kind not in KINDS and kind.startswith("fwd"):
                    kind = "fwd"
                recorded.append((kind, KernelConfig(**d)))
    recorded = list(dict.fromkeys(recorded))
    return list(dict.fromkeys(recorded + [(k, c) for kind, c in recorded if kind in ("fwd", "fwd_window")
                                        for k in kinds_for(c)]))


if __name__ == "__main__":
    from flashsink.ops.compiler.precompile import precompile

    pairs = recorded_pairs(sys.argv[1])
    print(f"{len(pairs)} recorded kernels and their configurations' others")
    sys.exit(1 if precompile([], pairs=pairs) else 0)
