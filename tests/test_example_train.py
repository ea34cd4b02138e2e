"""examples/train_gptoss_tiny.py runs end to end on CPU (3 steps) and its two loss curves agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed (pip install 'flashsink[hf]')")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gptoss_tiny.py"


@pytest.mark.l2
def test_train_example_three_steps(tmp_path):
    plot = tmp_path / "curves.png"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3", "--device", "cpu", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OK: the loss curves agree" in out
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(row[0]) for row in lines] == [1, 3]  # the first and the last step (and every 20th)
    assert "peak memory" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.is_file()
