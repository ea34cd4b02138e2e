"""Precompile, in parallel, every kernel configuration a test run recorded with
FLASHSINK_RECORD_KERNELS (one JSON object per line: kind and KernelConfig fields).

    python tools/precompile_recorded.py recorded.jsonl
"""

import json
import sys

if __name__ == "__main__":
    from flashsink.ops.config import KernelConfig
    from flashsink.ops.precompile import kinds_for, precompile

    configs = []
    with open(sys.argv[1]) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                d.pop("kind")
                configs.append(KernelConfig(**d))
    configs = list(dict.fromkeys(configs))
    print(f"{len(configs)} recorded configurations")
    pairs = [(k, c) for c in configs for k in kinds_for(c)]
    sys.exit(1 if precompile([], pairs=pairs) else 0)
