"""Every fenced ``python`` block of the README and of docs/api.md runs as written, each in a fresh interpreter
as a newcomer would paste it, on whatever device this machine has: on a CPU-only machine the blocks pick
the CPU (and gloo for the distributed ones, which run under torchrun as their first line says).

A block not meant to run is marked on the line before its fence with ``<!-- readme-test: skip (why) -->``;
the marked blocks are listed here, so that the list stays short and each one has its reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "api.md")  # the pages whose examples are programs
SKIP = re.compile(r"^<!-- readme-test: skip \((.+)\) -->$")
TORCHRUN = re.compile(r"^# torchrun --standalone --nproc-per-node (\d+) (\S+\.py)$")

#: the blocks not run: their first line, and why (the marker's text)
SKIPPED = {
    "flashsink.attention(q, k, v, sinks=None, *, window=None, causal=True, scale=None,": "signatures, not a program",
    "flashsink.attention_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, sinks=None,":
        "a signature, not a program",
    "from flashsink.ops.launch import dense": "a fragment: spec, q, k, v, sinks, do from the caller; launches CUDA kernels",
    "import torch": "downloads openai/gpt-oss-20b, about 40 GB, onto a GPU; tests/test_integrations.py runs a tiny model",
}


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number of the fence, the block's code, the skip reason or None) of every ```python block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            mark = SKIP.match(lines[start - 1].strip()) if start else None
            blocks.append((start + 1, "\n".join(body) + "\n", mark.group(1) if mark else None))
        i += 1
    return blocks


BLOCKS = [(doc, n, code, why) for doc in DOCS for n, code, why in python_blocks(doc.read_text())]


def test_the_skipped_blocks_are_the_listed_ones():
    skipped = {code.splitlines()[0]: why for _, _, code, why in BLOCKS if why is not None}
    assert skipped == SKIPPED
    assert sum(doc == README and why is None for doc, _, _, why in BLOCKS) >= 7  # the rest run, below


@pytest.mark.parametrize("doc, line, code", [(d, n, c) for d, n, c, why in BLOCKS if why is None],
                         ids=[f"{d.stem}-L{n}" for d, n, _, why in BLOCKS if why is None])
def test_readme_block_runs(doc, line, code, tmp_path):
    first = code.splitlines()[0]
    launch = TORCHRUN.match(first)
    script = tmp_path / (launch.group(2) if launch else f"readme_l{line}.py")
    script.write_text(code)
    if launch:  # as its first line says, with python -m torch.distributed.run (torchrun's module)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", launch.group(1),
               str(script)]
    else:
        cmd = [sys.executable, str(script)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, f"{doc.relative_to(ROOT)} line {line}:\n{code}\n--- stdout\n{run.stdout[-3000:]}\n" \
                                f"--- stderr\n{run.stderr[-5000:]}"
