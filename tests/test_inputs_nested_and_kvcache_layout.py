"""Issue 54, inputs: nested tensors are refused at every entry point with a TypeError naming the argument
(item 7), and ``attention_kvcache`` takes ``attention``'s ``layout=`` with its default (item 8)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.nn import SinkAttention

pytestmark = pytest.mark.boundary

H, HK, D = 4, 2, 8


def _nested(layout, *shapes, dtype=torch.float32):
    with warnings.catch_warnings():  # torch warns that the strided nested layout is a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.randn(*s).to(dtype) for s in shapes], layout=layout)


def _dense_args():
    q, k = torch.randn(2, H, 5, D), torch.randn(2, HK, 5, D)
    return dict(q=q, k=k, v=k.clone(), sinks=torch.zeros(H))


def _entry_points(layout):
    """(argument name, a call passing a nested tensor as that argument) for every public entry point."""
    a = _dense_args()
    nested4 = _nested(layout, (H, 5, D), (H, 3, D))  # [2, H, j, D]: a batch of two lengths
    nested3 = _nested(layout, (5, H, D), (3, H, D))
    t3 = torch.randn(8, H, D)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    kc = torch.randn(2, HK, 12, D)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    nested_int = _nested(layout, (2,), dtype=torch.int32)
    return [
        ("q", lambda: flashsink.attention(nested4, a["k"], a["v"], a["sinks"])),
        ("k", lambda: flashsink.attention(a["q"], nested4, a["v"])),
        ("v", lambda: reference.attention(a["q"], a["k"], nested4)),
        ("sinks", lambda: flashsink.attention(a["q"], a["k"], a["v"], _nested(layout, (H,)))),
        ("q", lambda: flashsink.attention_varlen(nested3, t3, t3, cu, cu, 5, 5)),
        ("cu_seqlens_k", lambda: flashsink.attention_varlen(t3, t3, t3, cu, nested_int, 5, 5)),
        ("q", lambda: flashsink.attention_kvcache(nested4, kc, kc, lens)),
        ("v_cache", lambda: flashsink.attention_kvcache(a["q"][:, :, :1], kc, nested4, lens)),
        ("cache_seqlens", lambda: flashsink.attention_kvcache(a["q"][:, :, :1], kc, kc, nested_int)),
        ("q", lambda: SinkAttention(H, HK, D)(nested4, a["k"], a["v"])),
        ("v", lambda: SinkAttention(H, HK, D)(a["q"], a["k"], nested4)),
    ]


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_a_type_error_naming_the_argument(layout):
    """Item 7: a nested tensor (the strided layout too, which reports ``layout == torch.strided`` and has no
    sizes) is a TypeError naming the argument at attention, attention_varlen, attention_kvcache and
    SinkAttention, not torch's ``RuntimeError: Internal error: NestedTensorImpl doesn't support sizes``."""
    for name, call in _entry_points(layout):
        with pytest.raises(TypeError, match=rf"^{name} must be a dense tensor, got a nested tensor") as info:
            call()
        assert "attention_varlen" in str(info.value)  # what to do instead


def test_kvcache_layout_is_attentions():
    """Item 8: the same argument with the same default, in the function and its reference."""
    want = inspect.signature(flashsink.attention).parameters["layout"].default
    assert want == "bhsd"
    for fn in (flashsink.attention_kvcache, reference.attention_kvcache):
        param = inspect.signature(fn).parameters.get("layout")
        assert param is not None and param.kind is param.KEYWORD_ONLY and param.default == want, fn


def _problem(layout, lengths=(7, 10), seq_q=1, heads=H, kv_heads=1, page=None, seed=0):
    """q, caches (contiguous, or paged with a shuffled block table) in ``layout``, and the dense k/v per row."""
    g = torch.Generator().manual_seed(seed)
    b, s_max = len(lengths), max(lengths)
    q = torch.randn(b, heads, seq_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s_max, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s_max, D, generator=g, dtype=torch.float64)
    rows = [(k[i : i + 1, :, :n], v[i : i + 1, :, :n]) for i, n in enumerate(lengths)]
    table = None
    if page is not None:  # pages [num_pages, H_kv, page, D] (bhsd), shuffled
        per = -(-s_max // page)
        kp = torch.nn.functional.pad(k, (0, 0, 0, per * page - s_max)).view(b, kv_heads, per, page, D)
        vp = torch.nn.functional.pad(v, (0, 0, 0, per * page - s_max)).view(b, kv_heads, per, page, D)
        kp, vp = (x.permute(0, 2, 1, 3, 4).reshape(b * per, kv_heads, page, D) for x in (kp, vp))
        perm = torch.randperm(b * per, generator=g)
        k, v = torch.empty_like(kp), torch.empty_like(vp)
        k[perm], v[perm] = kp, vp  # logical page j of row i lives at perm[i * per + j]
        table = perm.view(b, per).to(torch.int32)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return q, k, v, torch.tensor(lengths, dtype=torch.int32), table, rows


@pytest.mark.parametrize("page", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seq_q", [1, 3])
def test_kvcache_default_layout_is_bhsd(page, seq_q):
    """Item 8: with the default layout a ``[B, H, S_q, D]`` query with one KV head (the case that ran
    silently as ``[B, S_q=H, H=1, D]``) is read as attention reads it: the same numbers as
    ``flashsink.attention`` over each row's cached keys, o in q's layout; "bshd" gives the same numbers
    transposed."""
    q, kc, vc, lens, table, rows = _problem("bhsd", seq_q=seq_q, page=page)
    sinks = torch.randn(H, dtype=torch.float64)
    o, lse = flashsink.attention_kvcache(q, kc, vc, lens, block_table=table, sinks=sinks, window=6, return_lse=True)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (2, H, seq_q)
    for i, (k, v) in enumerate(rows):
        want_o, want_lse = flashsink.attention(q[i : i + 1], k, v, sinks, window=6, return_lse=True)
        torch.testing.assert_close(o[i : i + 1], want_o, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[i : i + 1], want_lse, rtol=0, atol=1e-12)
    qs, ks, vs, *_ = _problem("bshd", seq_q=seq_q, page=page)
    o2, lse2 = flashsink.attention_kvcache(qs, ks, vs, lens, block_table=table, sinks=sinks, window=6,
                                           layout="bshd", return_lse=True)
    assert o2.shape == qs.shape and torch.equal(o2.transpose(1, 2), o) and torch.equal(lse2, lse)


def test_kvcache_layout_mismatch_is_an_error_not_a_silent_answer():
    """Item 8: bshd tensors given without ``layout="bshd"`` (the old calls) do not run with another meaning:
    one KV head, q ``[B, S_q=1, H, D]``, cache ``[B, S_max, 1, D]`` read as bhsd gives H_kv = S_max."""
    qs, ks, vs, lens, _, _ = _problem("bshd")
    with pytest.raises(ValueError, match=r"q heads \(1\) must be a multiple of k/v heads \(10\).*layout='bhsd'"):
        flashsink.attention_kvcache(qs, ks, vs, lens)
    with pytest.raises(ValueError, match=r"^layout must be one of \('bhsd', 'bshd'\).*got 'thd'"):
        flashsink.attention_kvcache(qs, ks, vs, lens, layout="thd")
    with pytest.raises(ValueError, match=r"k_cache must be 4-D \[num_pages, H_kv, page_size, D\] for layout='bhsd'"):
        flashsink.attention_kvcache(qs, ks[0], vs, lens, block_table=lens[:, None])


def test_kvcache_op_takes_the_layout():
    """Item 8, the custom op: ``flashsink::kvcache_fwd(..., scale, layout)`` (opcheck: its fake's shapes and
    strides are the implementation's), and attention_kvcache compiled in either layout is the eager call."""
    q, kc, vc, lens, table, _ = _problem("bhsd", seq_q=2, heads=4, kv_heads=2, page=4)
    q, kc, vc = q.float(), kc.float(), vc.float()
    for layout, args in (("bhsd", (q, kc, vc)), ("bshd", tuple(x.transpose(1, 2).contiguous() for x in (q, kc, vc)))):
        op_args = (*args, lens, table, None, None, 0.3, layout)
        torch.library.opcheck(torch.ops.flashsink.kvcache_fwd.default, op_args)
        o, _ = torch.ops.flashsink.kvcache_fwd(*op_args)
        assert o.shape == args[0].shape and o.is_contiguous()

        def fn(q, k, v):
            return flashsink.attention_kvcache(q, k, v, lens, block_table=table, scale=0.3, layout=layout)

        with torch.no_grad():
            got = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)(*args)
        assert torch.equal(got, o) and torch.equal(fn(*args), o)


def test_kvcache_kernels_refuse_bhsd_caches():
    """Item 8 on CUDA: the kernels read bshd caches; a bhsd call is a NotImplementedError saying what is
    supported (checked before any launch: ``kvcache.check_supported``, which the CUDA path calls first),
    not a copy of the whole cache per call."""
    from flashsink._validate_kvcache import validate_kvcache
    from flashsink.ops.launch import kvcache

    q, kc, vc, lens, table, _ = _problem("bhsd", page=4)
    spec = validate_kvcache(q, kc, vc, lens, table, None, window=None, scale=None, return_lse=False, layout="bhsd")
    with pytest.raises(NotImplementedError, match=r"layout 'bshd' on CUDA.*got layout='bhsd'.*pass layout='bshd'"):
        kvcache.kernel_attention_kvcache(spec, q, kc, vc, lens, table, None, return_lse=False)
