"""``flashsink.nn.SinkAttention``: shapes, agreement with the reference, gradient to the sinks,
initialisation, validation (CPU)."""

from __future__ import annotations

import pytest
import torch

import flashsink
from flashsink.nn import SinkAttention

pytestmark = pytest.mark.l1

def test_sink_attention_shapes_and_reference():
    torch.manual_seed(0)
    attn = SinkAttention(8, 2, 32, window=5)
    q, k, v = torch.randn(2, 8, 12, 32), torch.randn(2, 2, 12, 32), torch.randn(2, 2, 12, 32)
    o, lse = attn(q, k, v, return_lse=True)
    assert o.shape == (2, 8, 12, 32) and lse.shape == (2, 8, 12)
    ref = flashsink.reference.attention(q, k, v, attn.sinks.detach(), window=5)
    torch.testing.assert_close(o, ref)

    bshd = SinkAttention(8, 2, 32, layout="bshd")
    o2 = bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert o2.shape == (2, 12, 8, 32)


def test_sink_attention_gradient_reaches_sinks():
    torch.manual_seed(0)
    attn = SinkAttention(4, 4, 16)
    q, k, v = (torch.randn(1, 4, 6, 16, requires_grad=True) for _ in range(3))
    attn(q, k, v).square().sum().backward()
    assert attn.sinks.grad is not None and attn.sinks.grad.shape == (4,)
    assert torch.isfinite(attn.sinks.grad).all() and attn.sinks.grad.abs().sum() > 0
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_sink_attention_init_and_repr():
    torch.manual_seed(0)
    attn = SinkAttention(4096, 8, 64, window=128)
    assert isinstance(attn.sinks, torch.nn.Parameter) and attn.sinks.shape == (4096,)
    assert abs(attn.sinks.std().item() - 0.02) < 0.002 and abs(attn.sinks.mean().item()) < 0.002
    r = repr(attn)
    for part in ("num_heads=4096", "num_kv_heads=8", "head_dim=64", "window=128", "causal=True", "layout='bhsd'"):
        assert part in r
    assert SinkAttention(4).num_kv_heads == 4
    assert attn.precision == "fast" and "precision='fast'" in r
    assert SinkAttention(4, precision="strict").precision == "strict"


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(num_heads=0), "num_heads"),
        (dict(num_heads=8, num_kv_heads=3), "num_kv_heads"),
        (dict(num_heads=8, head_dim=0), "head_dim"),
        (dict(num_heads=8, window=0), "window"),
        (dict(num_heads=8, window=4, causal=False), "window"),
        (dict(num_heads=8, causal=1), "causal"),
        (dict(num_heads=8, scale=-1.0), "scale"),
        (dict(num_heads=8, layout="sbhd"), "layout"),
        (dict(num_heads=8, init_std=-1.0), "init_std"),
        (dict(num_heads=8, precision="exact"), "precision"),
        (dict(num_heads=8, precision=None), "precision"),
    ],
)
def test_sink_attention_validation(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        SinkAttention(**kwargs)


def test_sink_attention_input_mismatch_raises():
    attn = SinkAttention(8, 2, 32)
    with pytest.raises(ValueError, match="heads"):
        attn(torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))
    with pytest.raises(ValueError, match="head_dim"):
        attn(torch.randn(1, 8, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
