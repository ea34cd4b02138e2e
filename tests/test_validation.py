"""Every user error of flashsink.attention / attention_varlen: the right exception, and a message
that names the argument."""

from __future__ import annotations

import pytest
import torch

import flashsink
import flashsink.nn
from flashsink import reference
from flashsink._validate import validate_attention

pytestmark = pytest.mark.boundary


def qkvs(b=2, h=4, hk=2, sq=5, skv=5, d=8, dtype=torch.float32, layout="bhsd"):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    if layout == "bhsd":
        return r(b, h, sq, d), r(b, hk, skv, d), r(b, hk, skv, d), r(h).float()
    return r(b, sq, h, d), r(b, skv, hk, d), r(b, skv, hk, d), r(h).float()


def call(q, k, v, s=None, **kw):
    return flashsink.attention(q, k, v, s, **kw)


# --- TypeError --------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["q", "k", "v", "sinks"])
def test_non_tensor(which):
    args = dict(zip(("q", "k", "v", "sinks"), qkvs()))
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=rf"^{which} must be a torch.Tensor, got list"):
        call(args["q"], args["k"], args["v"], args["sinks"])


@pytest.mark.parametrize("which", ["q", "k", "v", "sinks"])
def test_non_floating(which):
    args = dict(zip(("q", "k", "v", "sinks"), qkvs()))
    args[which] = args[which].to(torch.int32)
    with pytest.raises(TypeError, match=rf"^{which} must have a floating-point dtype.*got torch.int32"):
        call(args["q"], args["k"], args["v"], args["sinks"])


@pytest.mark.parametrize("window", [2.0, "4", True])
def test_window_not_int(window):
    with pytest.raises(TypeError, match="window must be an int"):
        call(*qkvs(), window=window)


@pytest.mark.parametrize("causal", [1, None, "yes"])
def test_causal_not_bool(causal):
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(*qkvs(), causal=causal)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1), 1j])
def test_scale_not_real(scale):
    with pytest.raises(TypeError, match="scale must be a real number"):
        call(*qkvs(), scale=scale)


def test_scale_not_finite():
    with pytest.raises(ValueError, match="scale must be finite"):
        call(*qkvs(), scale=float("nan"))


def test_deterministic_not_bool():
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        call(*qkvs(), deterministic=1)


# --- ValueError -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bsdh", "BHSD", None])
def test_layout(layout):
    with pytest.raises(ValueError, match=r"layout must be one of \('bhsd', 'bshd'\)"):
        call(*qkvs(), layout=layout)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_4d(which):
    args = dict(zip(("q", "k", "v", "sinks"), qkvs()))
    args[which] = args[which][0]
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D \[B, H, S, D\].*got 3-D"):
        call(args["q"], args["k"], args["v"], args["sinks"])


def test_not_4d_bshd_message():
    q, k, v, s = qkvs(layout="bshd")
    with pytest.raises(ValueError, match=r"q must be 4-D \[B, S, H, D\] for layout='bshd'"):
        call(q[0], k, v, s, layout="bshd")


def test_batch_mismatch():
    q, k, v, s = qkvs()
    with pytest.raises(ValueError, match=r"k batch \(1\) must equal q batch \(2\)"):
        call(q, k[:1], v[:1], s)


def test_head_dim_mismatch():
    q, k, v, s = qkvs()
    with pytest.raises(ValueError, match=r"k head_dim \(4\) must equal q head_dim \(8\)"):
        call(q, k[..., :4], v, s)


@pytest.mark.parametrize("dim", [0, 1, 2], ids=["batch", "heads", "seq"])
def test_k_v_mismatch(dim):
    q, k, v, s = qkvs(b=2, h=4, hk=2)
    v = v.narrow(dim, 0, 1)
    with pytest.raises(ValueError, match=r"v must match k in batch, heads and sequence length"):
        call(q, k if dim != 0 else k, v, s)


def test_k_v_mismatch_bshd():
    q, k, v, s = qkvs(layout="bshd", skv=6)
    with pytest.raises(ValueError, match=r"v must match k .*\(bshd\)"):
        call(q, k, v[:, :3], s, layout="bshd")


def test_dtype_mismatch():
    q, k, v, s = qkvs()
    with pytest.raises(ValueError, match=r"q, k and v must share one dtype, got q torch.float32, k torch.float16"):
        call(q, k.half(), v, s)


def test_device_mismatch():
    q, k, v, s = qkvs()
    with pytest.raises(ValueError, match=r"q, k and v must be on one device"):
        call(q, k.to("meta"), v, s)
    with pytest.raises(ValueError, match=r"sinks must be on the same device as q"):
        call(q, k, v, s.to("meta"))


def test_heads_not_multiple():
    q, k, v, s = qkvs(h=6, hk=4)
    with pytest.raises(ValueError, match=r"q heads \(6\) must be a multiple of k/v heads \(4\)"):
        call(q, k, v, s)


def test_zero_heads_and_head_dim():
    q, k, v, s = qkvs()
    with pytest.raises(ValueError, match=r"at least one head"):
        call(q, k[:, :0], v[:, :0], s)
    with pytest.raises(ValueError, match=r"head dims must be >= 1"):
        call(q[..., :0], k[..., :0], v[..., :0], s)


@pytest.mark.parametrize("bad", ["2d", "short", "long", "scalar"])
def test_sinks_shape(bad):
    q, k, v, s = qkvs(h=4)
    s = {"2d": s[None], "short": s[:3], "long": torch.cat([s, s]), "scalar": s[0]}[bad]
    with pytest.raises(ValueError, match=r"sinks must be 1-D of shape \[4\]"):
        call(q, k, v, s)


@pytest.mark.parametrize("window", [0, -3])
def test_window_below_one(window):
    with pytest.raises(ValueError, match=rf"window must be >= 1.*got {window}"):
        call(*qkvs(), window=window)


def test_window_needs_causal():
    with pytest.raises(ValueError, match=r"a sliding window needs causal=True"):
        call(*qkvs(), window=3, causal=False)


def test_valid_inputs_pass():
    spec = validate_attention(*qkvs(h=6, hk=3, d=16), window=2, causal=True, scale=None, layout="bhsd")
    assert (spec.heads, spec.kv_heads, spec.groups, spec.head_dim) == (6, 3, 2, 16)
    assert spec.scale == pytest.approx(0.25) and spec.has_sinks and spec.window == 2


# --- varlen -----------------------------------------------------------------------------------

def varlen_args(lens=(3, 5), h=4, hk=2, d=8):
    g = torch.Generator().manual_seed(1)
    t = sum(lens)
    cu = torch.tensor((0,) + tuple(lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        q=torch.randn(t, h, d, generator=g), k=torch.randn(t, hk, d, generator=g),
        v=torch.randn(t, hk, d, generator=g), cu_seqlens_q=cu, cu_seqlens_k=cu.clone(),
        max_seqlen_q=max(lens), max_seqlen_k=max(lens), sinks=torch.randn(h, generator=g),
    )


def vcall(**over):
    args = varlen_args()
    args.update(over)
    return flashsink.attention_varlen(**args)


def test_varlen_ok():
    assert vcall().shape == (8, 4, 8)


def test_varlen_not_3d():
    a = varlen_args()
    with pytest.raises(ValueError, match=r"q must be 3-D \[total_tokens, heads, head_dim\]"):
        vcall(q=a["q"][None])


def test_varlen_head_mismatch():
    a = varlen_args()
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        vcall(k=torch.randn(8, 3, 8), v=torch.randn(8, 3, 8))
    with pytest.raises(ValueError, match=r"v must match k in total tokens and heads"):
        vcall(v=a["v"][:, :1])
    with pytest.raises(ValueError, match=r"k head_dim \(4\) must equal q head_dim \(8\)"):
        vcall(k=a["k"][..., :4])


def test_varlen_cu_seqlens_types():
    a = varlen_args()
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be a torch.Tensor"):
        vcall(cu_seqlens_q=[0, 3, 8])
    with pytest.raises(TypeError, match=r"cu_seqlens_k must have dtype int32 or int64, got torch.float32"):
        vcall(cu_seqlens_k=a["cu_seqlens_k"].float())
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be 1-D"):
        vcall(cu_seqlens_q=a["cu_seqlens_q"][None])


def test_varlen_cu_seqlens_values():
    i32 = torch.int32
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0"):
        vcall(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=i32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing"):
        vcall(cu_seqlens_k=torch.tensor([0, 6, 5, 8], dtype=i32), cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=i32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal the total number of tokens \(8\), got 7"):
        vcall(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=i32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must have the same length"):
        vcall(cu_seqlens_q=torch.tensor([0, 3, 4, 8], dtype=i32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be on the same device as q"):
        vcall(cu_seqlens_q=torch.tensor([0, 3, 8], dtype=i32, device="meta"))


def test_varlen_offsets_checked_once_while_unchanged(monkeypatch):
    """attention_varlen copies CUDA offsets to the host (a wait for the GPU) only when they were not
    checked since they last changed: the same tensor, version counter, total and max_seqlen. Here the
    record a CUDA check leaves (``_remember``) is made for CPU offsets, whose copy is free and which
    are otherwise checked every call."""
    from flashsink import _validate

    copies = []
    real = _validate._varlen_values
    monkeypatch.setattr(_validate, "_varlen_values", lambda *a: (copies.append(1), real(*a)))
    monkeypatch.setattr(_validate, "_remember", lambda cu, total, m: _validate._CHECKED.__setitem__(
        cu, (_validate._version(cu), total, m)))
    a = varlen_args()
    flashsink.attention_varlen(**a)
    flashsink.attention_varlen(**a)
    assert len(copies) == 1  # the second call found both offsets checked
    flashsink.attention_varlen(**{**a, "max_seqlen_q": 6})
    assert len(copies) == 2  # another max_seqlen: checked again
    a["cu_seqlens_k"][1] = 3  # in place: a new version, so checked again (and still valid)
    flashsink.attention_varlen(**a)
    assert len(copies) == 3
    a["cu_seqlens_k"][1] = 9  # past the total: caught although this tensor was checked before
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flashsink.attention_varlen(**a)


def test_varlen_max_seqlen():
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest sequence \(5\), got 4"):
        vcall(max_seqlen_q=4)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an int"):
        vcall(max_seqlen_k=5.0)


def test_varlen_options():
    with pytest.raises(ValueError, match=r"a sliding window needs causal=True"):
        vcall(window=2, causal=False)
    with pytest.raises(TypeError, match=r"sinks must have a floating-point dtype"):
        vcall(sinks=torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"sinks must be 1-D of shape \[4\]"):
        vcall(sinks=torch.ones(3))
    with pytest.raises(ValueError, match=r"q, k and v must share one dtype"):
        vcall(q=varlen_args()["q"].double())


# ---------------------------------------------------------------------------------------------
# issue 16: the custom ops validate as the public functions; flags, scale, window, dtypes, meta


def _small(dtype=torch.float32, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 16, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("change, error, needle", [
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(window=4, causal=False), ValueError, "needs causal=True"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(scale=1e39), ValueError, "finite in float32"),
    (dict(dtype=torch.int64), TypeError, "floating-point dtype"),
    (dict(layout="sbhd"), ValueError, "layout"),
])
def test_ops_validate_like_attention(change, error, needle):
    q, k, v = _small(change.pop("dtype", torch.float32))
    args = {**dict(window=None, causal=True, scale=0.25, layout="bhsd"), **change}
    with pytest.raises(error, match=needle):
        torch.ops.flashsink.fwd(q, k, v, None, args["window"], args["causal"], args["scale"], args["layout"], False)


def test_bwd_op_checks_the_gradient_shapes():
    q, k, v = _small()
    o, lse = torch.ops.flashsink.fwd(q, k, v, None, None, True, 0.25, "bhsd", False)
    torch.ops.flashsink.bwd(torch.randn_like(o), q, k, v, None, lse, None, None, True, 0.25, "bhsd", False)
    for do, lse_, needle in [(torch.randn(1, 2, 8, 8), lse, "do"), (torch.randn_like(o), lse[..., :8], "lse")]:
        with pytest.raises(ValueError, match=needle):
            torch.ops.flashsink.bwd(do, q, k, v, None, lse_, None, None, True, 0.25, "bhsd", False)


def test_varlen_op_checks_cu_seqlens_values():
    x = torch.randn(5, 2, 16)
    good = torch.tensor([0, 4, 5], dtype=torch.int32)
    torch.ops.flashsink.varlen_fwd(x, x, x, None, good, good, 4, 4, None, True, 0.25, False)
    for cu, needle in [([0, 4, 2], "non-decreasing"), ([0, 4, 9], r"\[-1\] must equal"), ([1, 4, 5], "start at 0")]:
        bad = torch.tensor(cu, dtype=torch.int32)
        with pytest.raises(ValueError, match=needle):  # was: 4 rows back for 5 tokens
            torch.ops.flashsink.varlen_fwd(x, x, x, None, bad, good, 4, 4, None, True, 0.25, False)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= the longest sequence"):
        torch.ops.flashsink.varlen_fwd(x, x, x, None, good, good, 3, 4, None, True, 0.25, False)
    with pytest.raises(ValueError, match="window must be >= 1"):
        torch.ops.flashsink.varlen_fwd(x, x, x, None, good, good, 4, 4, 0, True, 0.25, False)


@pytest.mark.parametrize("flag", ["return_lse", "deterministic"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_flags_must_be_bools(flag, value):
    q, k, v = _small()
    with pytest.raises(TypeError, match=flag):
        flashsink.attention(q, k, v, **{flag: value})
    x = q[0].transpose(0, 1)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match=flag):
        flashsink.attention_varlen(x, x, x, cu, cu, 8, 8, **{flag: value})
    if flag == "return_lse":
        with pytest.raises(TypeError, match=flag):
            reference.attention(q, k, v, return_lse=value)
        with pytest.raises(TypeError, match=flag):
            flashsink.nn.SinkAttention(2, head_dim=16)(q, k, v, return_lse=value)


def test_sink_init_std_must_be_finite():
    with pytest.raises(ValueError, match="init_std"):
        flashsink.nn.SinkAttention(2, head_dim=16, init_std=float("inf"))


def test_huge_window_is_no_window():
    q, k, v = _small()
    torch.testing.assert_close(flashsink.attention(q, k, v, window=2 ** 64), flashsink.attention(q, k, v))


def test_scale_must_be_finite_in_float32():
    q, k, v = _small()
    with pytest.raises(ValueError, match="finite in float32"):  # was: all NaN
        flashsink.attention(q, k, v, scale=1e39)
    with pytest.raises(ValueError, match="finite in float32"):
        flashsink.attention(*_small(torch.bfloat16), scale=-1e39)
    assert flashsink.attention(*_small(torch.float64), scale=1e-3).isfinite().all()  # float64 computes in float64


def test_float8_inputs_are_refused():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        flashsink.attention(*_small(torch.float8_e4m3fn))


def test_attention_varlen_on_meta_tensors():
    x = torch.empty(12, 4, 16, device="meta")
    kv = torch.empty(12, 2, 16, device="meta")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="meta")
    o, lse = flashsink.attention_varlen(x, kv, kv, cu, cu, 7, 7, return_lse=True)
    assert o.shape == (12, 4, 16) and o.device.type == "meta" and lse.shape == (4, 12)
    o = flashsink.attention(*(t.to("meta") for t in _small()))
    assert o.shape == (1, 2, 8, 16)


def test_validation_memo_returns_the_checked_spec_and_still_refuses():
    """validate_attention remembers the spec of arguments it has checked (by types, shapes, dtypes,
    devices and the options' values and types: the checks read nothing else), so a repeated call costs
    a lookup; any argument that changes what a check reads is checked again, and refused if it fails."""
    from flashsink import _validate

    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    sinks = torch.randn(4)
    kw = dict(window=4, causal=True, scale=None, layout="bhsd")
    spec = validate_attention(q, k, v, sinks, **kw)
    assert validate_attention(q.clone(), k, v, sinks, **kw) is spec  # other tensors, same facts
    assert validate_attention(q, k, v, sinks, **{**kw, "window": 5}).window == 5
    assert validate_attention(q, k, v, None, **kw).has_sinks is False
    assert validate_attention(q, k, v, sinks, **{**kw, "scale": 1}).scale == 1.0
    with pytest.raises(ValueError, match="dtype"):
        validate_attention(q, k.double(), v, sinks, **kw)
    with pytest.raises(ValueError, match="sinks"):
        validate_attention(q, k, v, torch.randn(3), **kw)
    with pytest.raises(TypeError, match="window"):
        validate_attention(q, k, v, sinks, **{**kw, "window": True})
    with pytest.raises(ValueError, match="batch"):
        validate_attention(q, k[:, :, :15].expand(2, 2, 15, 8), v, sinks, **kw)
    # a tensor scale is not a key (its value could change): checked, and refused, every call
    with pytest.raises(TypeError):
        validate_attention(q, k, v, sinks, **{**kw, "scale": torch.tensor(0.1)})
    assert _validate._spec_key(q, k, v, sinks, 4, True, torch.tensor(0.1), "bhsd") is None
    assert _validate._spec_key([1], k, v, sinks, 4, True, None, "bhsd") is None
