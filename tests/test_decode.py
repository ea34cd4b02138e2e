"""Split-KV decode (``flashsink.ops.decode``): when it is chosen, how many splits, and the merge of
the partials, on the CPU against the reference (the GPU tests run the kernel itself)."""

from dataclasses import replace

import pytest
import torch

from flashsink import reference
from flashsink._validate import validate_attention
from flashsink.ops.config import KernelConfig
from flashsink.ops.decode import combine_splits, n_splits_for, use_split
from flashsink.testing import check_precision


def _spec(b=1, h=64, hk=8, sq=1, skv=4096, window=None, layout="bhsd"):
    q = torch.empty(b, h, sq, 64) if layout == "bhsd" else torch.empty(b, sq, h, 64)
    k = torch.empty(b, hk, skv, 64) if layout == "bhsd" else torch.empty(b, skv, hk, 64)
    return validate_attention(q, k, k, None, window=window, causal=True, scale=None, layout=layout)


def _cfg(groups=8, layout="bhsd"):
    return KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=64, head_dim_v=64, groups=groups,
                        causal=True, has_sinks=True, layout=layout)


@pytest.mark.l0
def test_split_is_chosen_for_decode_only():
    assert use_split(_spec(), _cfg())  # one row per head, 4k keys
    assert use_split(_spec(sq=8), _cfg())  # 8 heads x 8 rows = one 64-row tile
    assert not use_split(_spec(sq=9), _cfg())  # 72 rows do not fit
    assert not use_split(_spec(skv=300), _cfg())  # short cache: the regular kernel
    assert not use_split(_spec(window=128), _cfg())  # a window leaves few keys per row
    assert not use_split(replace(_spec(), layout="thd"), _cfg(layout="thd"))
    assert not use_split(_spec(), replace(_cfg(), arch="sm_80"))  # Hopper-only kernel


@pytest.mark.l0
def test_split_count_fills_the_gpu_with_enough_work_each():
    assert n_splits_for(_spec(b=1), _cfg(), 132) == 8  # 8 groups: 264 programs wanted, 32 blocks / 4
    assert n_splits_for(_spec(b=1, skv=65536), _cfg(), 132) == 33
    assert n_splits_for(_spec(b=64, skv=65536), _cfg(), 132) == 1  # 512 programs already
    assert n_splits_for(_spec(skv=600), _cfg(), 132) == 1


@pytest.mark.l1
@pytest.mark.parametrize("sinks", [True, False])
def test_combine_splits_equals_unsplit(sinks):
    """Partials over disjoint key ranges (one of them empty) merge into the full result."""
    g = torch.Generator().manual_seed(11)
    B, H, Hk, Sq, S, D = 2, 8, 2, 3, 700, 32
    q = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) * 2 if sinks else None
    want_o, want_lse = reference.attention(q, k, v, s, causal=False, return_lse=True)
    cuts = [0, 100, 100, 450, 700]  # the second range is empty
    o_parts, lse_parts = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            o_parts.append(torch.zeros(B, H, Sq, D, dtype=torch.float64))
            lse_parts.append(torch.full((B, H, Sq), float("-inf"), dtype=torch.float64))
            continue
        o, lse = reference.attention(q, k[:, :, a:b], v[:, :, a:b], None, causal=False, return_lse=True)
        o_parts.append(o)
        lse_parts.append(lse)
    o, lse = combine_splits(torch.stack(o_parts, dim=3), torch.stack(lse_parts, dim=3),
                            None if s is None else s, sinks)
    for name, got, want in (("o", o, want_o), ("lse", lse, want_lse)):
        rep = check_precision(name, got.float(), want, torch.float32)
        assert rep.passed, rep.row()
