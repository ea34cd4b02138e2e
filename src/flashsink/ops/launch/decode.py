"""Split-KV forward for few query rows against long KV caches (decode, short chunks).

With one query row per head the regular forward has one program per (row tile, head,
batch): a few hundred programs, each streaming the whole cache alone. The split-KV kernel
(``fwd_split.py``)

- packs the query rows of every head of a GQA group into one tile (``groups * seq_q``
  rows), so each K/V tile is read once per group, not once per query head;
- splits the visible KV blocks over ``n_splits`` programs, each writing a partial output
  (fp32) and its LSE without the sink;

and one small kernel (``merge_splits.py``) merges the partials and applies each head's sink once:
``lse = logsumexp([lse_1 .. lse_S, sink])``, ``o = sum_s exp(lse_s - lse) o_s``, the algebra of
:func:`flashsink.combine.merge_stacked`, the code behind :func:`flashsink.combine` (the tests judge
the kernel against a torch twin of it, ``tests/gpu_cases.combine_splits``). The LSE is the regular
one (sink included), so the backward is the regular one. Nothing here imports tilelang.
"""

import math

import torch

from ...visibility import visible_span
from ...kernel_config import LOG2E, SPLIT_ROWS, split_tiles


def visible_keys(spec) -> int:
    """Keys the packed tile of all query rows visits (every row's range lies inside)."""
    return visible_span(spec.seq_q, spec.seq_kv, spec.window)


def use_split(spec, cfg) -> bool:
    """Split-KV whenever a GQA group's query rows fit one packed tile and the keys are many:
    decode and short chunks against long caches. The packed tile reads each K/V tile once per
    group instead of once per query head, and the split fills the GPU with a few rows."""
    return (
        cfg.hopper  # sm_80's code generator rejects this kernel (TileLang 0.1.15): regular forward there
        and cfg.layout != "thd"
        and cfg.groups * spec.seq_q <= SPLIT_ROWS
        and visible_keys(spec) >= 512
    )


def n_splits_for(spec, cfg, sm_count: int) -> int:
    """Enough programs for about two waves, with at least four KV blocks each."""
    programs = spec.batch * (spec.heads // cfg.groups)
    blocks = -(-visible_keys(spec) // split_tiles(cfg).block_n)
    return max(1, min(math.ceil(2 * sm_count / programs), blocks // 4))


def forward_split(q, k, v, sinks32, cfg, spec, window, sm_count: int, lse_rows: int):
    """The split-KV forward: o in q's layout and dtype, lse ``[B, H, lse_rows]`` (rows past
    ``seq_q`` unwritten). Two launches: the split kernel's partials, then ``merge_splits.py``, the
    kernel twin of ``flashsink.combine.merge_stacked`` (sink applied once, o cast into q's layout)."""
    from ..compiler.registry import get_kernel

    B, H, Sq, Dv = spec.batch, spec.heads, spec.seq_q, cfg.head_dim_v  # the kernels' (padded) head dim
    S = n_splits_for(spec, cfg, sm_count)
    # two allocations: on the GPU host a slice or a view costs as much as an allocation (perf-log.md v8)
    o_part = torch.empty((B, H, Sq, S, Dv), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, H, Sq, S), dtype=torch.float32, device=q.device)
    get_kernel("fwd_split", cfg)(q, k, v, window, float(spec.scale) * LOG2E, o_part, lse_part)
    o = torch.empty((*q.shape[:-1], Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, lse_rows), dtype=torch.float32, device=q.device)
    get_kernel("merge_splits", cfg)(o_part, lse_part, sinks32, o, lse)
    return o, lse
