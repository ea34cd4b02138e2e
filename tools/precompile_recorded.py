"""Precompile, in parallel, every kernel configuration a test run recorded with
FLASHSINK_RECORD_KERNELS (one JSON object per line: kind and KernelConfig fields).

    python tools/precompile_recorded.py recorded.jsonl
"""

import json
import sys

if __name__ == "__main__":
    from flashsink.ops.config import KernelConfig
    from flashsink.ops.precompile import kinds_for, precompile

    recorded = []
    with open(sys.argv[1]) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                kind = d.pop("kind")
                recorded.append((kind, KernelConfig(**d)))
    recorded = list(dict.fromkeys(recorded))
    print(f"{len(recorded)} recorded kernels")
    # each recorded kernel, and with a recorded forward the rest of its configuration's forward and
    # backward (a test that records the forward may stop before its backward); not the kinds of a
    # configuration seen only through a lone kernel (merge_splits' float32 partials are no fwd's dtype)
    pairs = list(dict.fromkeys(recorded + [(k, c) for kind, c in recorded if kind == "fwd" for k in kinds_for(c)]))
    sys.exit(1 if precompile([], pairs=pairs) else 0)
