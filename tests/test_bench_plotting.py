"""bench/plotting.py: the plot's title for one run and for a merged result."""

from __future__ import annotations

import pytest

from flashsink import bench

pytestmark = pytest.mark.l1


@pytest.mark.l0
def test_plot_title_of_one_run_and_of_a_merged_result():
    """`--plot` titles a single run by its header, and tools/bench_merge.py's merged result (no
    top-level header: one per run) by every run's device, commit and date range."""
    h1 = {"device": "NVIDIA H200", "commit": "a" * 40, "date": "2026-12-03 03:21 UTC"}
    h2 = dict(h1, commit="b" * 40, date="2026-12-03 03:40 UTC")
    assert bench.plot_title({"header": h1, "rows": []}) == \
        "flashsink bench - NVIDIA H200 - aaaaaaaaaaaa - 2026-12-03 03:21 UTC"
    merged = {"runs": [{"header": h1}, {"header": h2}], "rows": []}
    assert bench.plot_title(merged) == ("flashsink bench - NVIDIA H200 - aaaaaaaaaaaa, bbbbbbbbbbbb - "
                                        "2026-12-03 03:21 UTC .. 2026-12-03 03:40 UTC")
