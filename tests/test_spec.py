"""One problem description: the AttnSpec's kernel key, and the one head-dim rule that check_supported,
the custom ops and `flashsink precompile` share (no GPU: the architecture query is stubbed)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flashsink._validate import AttnSpec, validate_attention, validate_varlen
from flashsink.cli import main
from flashsink import kernel_config as config
from flashsink.ops.launch import custom_ops, dense
from flashsink.kernel_config import NATIVE_HEAD_DIMS, kernel_head_dim


def _spec(d=64, dv=64, **kw):
    args = dict(window=None, causal=True, scale=None, layout="bshd", dtype=torch.bfloat16, has_sinks=True)
    args.update(kw)
    return AttnSpec(2, 8, 2, 100, 120, d, dv, **args)


@pytest.mark.l0
def test_head_dim_rule_is_the_documented_one():
    """Multiples of 16 in [16, 256], each run on the smallest native tile that holds it; nothing else."""
    for d in range(-16, 300):
        want = None
        if d % 16 == 0 and 16 <= d <= 256:
            want = min(n for n in NATIVE_HEAD_DIMS if n >= d)
        assert kernel_head_dim(d) == want, d


@pytest.mark.boundary
@pytest.mark.parametrize("d", [8, 20, 72, 100, 272, 512])
def test_every_entry_point_refuses_what_the_rule_refuses(d, capsys):
    for spec in (_spec(d=d), _spec(dv=d)):
        with pytest.raises(NotImplementedError, match="multiples of 16 up to 256"):
            dense.check_supported(spec)
    assert main(["precompile", "--dry-run", "--head-dim", str(d)]) == 2
    assert f"--head-dim: {d} is not one of the kernels' head dims" in capsys.readouterr().err


@pytest.mark.l0
@pytest.mark.parametrize("d", [16, 48, 64, 80, 96, 128, 160, 256])
def test_every_entry_point_takes_what_the_rule_takes(d, monkeypatch):
    monkeypatch.setattr(config, "_arch_of_index", lambda index: "sm_90a")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the ops' plan: q's device (CPU here)
    dev = torch.device("cuda", 0)
    dense.check_supported(_spec(d=d, dv=d))
    cfg = dense.kernel_config(_spec(d=d, dv=d), dev, False)
    assert (cfg.head_dim, cfg.head_dim_v) == (kernel_head_dim(d),) * 2
    q = torch.randn(2, 100, 8, d, dtype=torch.bfloat16)
    k = torch.randn(2, 120, 2, d, dtype=torch.bfloat16)
    if kernel_head_dim(d) == d:  # the ops take the native dims unpadded
        assert custom_ops._kernel_inputs(_spec(d=d, dv=d), False, "fast", q, k, k, None)[0].cfg is cfg
    else:
        with pytest.raises(ValueError, match=f"the q/k head dim is {d}"):
            custom_ops._kernel_inputs(_spec(d=d, dv=d), False, "fast", q, k, k, None)


@pytest.mark.l0
def test_kernel_key_holds_no_length(monkeypatch):
    """Specs that differ in batch, lengths, scale or window share one configuration; each fact of the
    key changes it (the key is the spec's, not rebuilt by the caller)."""
    monkeypatch.setattr(config, "_arch_of_index", lambda index: "sm_90a")
    dev = torch.device("cuda", 0)
    base = _spec()
    cfg = dense.kernel_config(base, dev, False)
    for same in (dataclasses.replace(base, batch=7, seq_q=3, seq_kv=4000), _spec(scale=0.3, window=17)):
        assert same.kernel_key == base.kernel_key and dense.kernel_config(same, dev, False) is cfg
    changed = {
        "dtype": _spec(dtype=torch.float16), "head_dim": _spec(d=128), "head_dim_v": _spec(dv=128),
        "groups": dataclasses.replace(base, kv_heads=8), "causal": _spec(causal=False),
        "has_sinks": _spec(has_sinks=False), "layout": _spec(layout="bhsd"),
    }
    for field, spec in changed.items():
        other = dense.kernel_config(spec, dev, False)
        assert getattr(other, field) != getattr(cfg, field), field
        assert dataclasses.replace(other, **{field: getattr(cfg, field)}) == cfg, field  # that fact only


@pytest.mark.l0
def test_validators_and_one_sequence_build_the_same_spec():
    """validate_attention, validate_varlen and the per-sequence specs of a packed batch all go through
    AttnSpec: the default scale and the window clamp are applied once, the same way."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 32, generator=g)
    k = torch.randn(2, 7, 2, 32, generator=g)
    spec = validate_attention(q, k, k, None, window=2**70, causal=True, scale=None, layout="bshd")
    assert spec == AttnSpec(2, 4, 2, 5, 7, 32, 32, window=2**70, causal=True, scale=None, layout="bshd",
                            dtype=q.dtype, has_sinks=False)
    assert spec.scale == 1 / math.sqrt(32) and spec.window < 2**63  # clamped to what int64 holds
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cuk = torch.tensor([0, 7, 14], dtype=torch.int32)
    packed = validate_varlen(q.reshape(10, 4, 32), k.reshape(14, 2, 32), k.reshape(14, 2, 32), cu, cuk, 5, 7, None,
                             window=2**70, causal=True, scale=None)
    assert packed.layout == "thd" and packed.one_sequence(5, 7) == dataclasses.replace(spec, batch=1)
