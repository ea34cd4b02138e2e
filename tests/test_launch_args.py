"""The host side of the CUDA path on the CPU: which kernels ``launch.dense`` / ``varlen`` launch, and
with exactly which arguments.

The kernel cache answers a recorder for every key (no tilelang, no GPU), the architecture is
reported as sm_90a or sm_80, and the launch functions run on CPU tensors. Every argument of
every launch is checked: the caller's tensors passed in place, each buffer's shape, dtype and
strides, the buffers that must arrive zeroed (or holding dlse), scalars with their types, and
which buffers one launch hands to the next. This is the launch protocol of ops/kernels/fwd.py and
ops/kernels/bwd.py, written out; it must not change when the host code is reorganised.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from flashsink._validate import validate_attention, validate_varlen
from flashsink.ops.compiler import registry
from flashsink.ops.launch import attention, custom_ops, dense
from flashsink import kernel_config as config
from flashsink.ops.compiler import kinds
from flashsink.kernel_config import LOG2E, NO_WINDOW, KernelConfig

pytestmark = pytest.mark.l0


#: the forward's kinds: one launch protocol (``kinds.forward_kind`` picks one per call)
FORWARDS = kinds.forward_kinds()


class Launch:
    def __init__(self, kind, cfg, args):
        # ``kind`` the protocol ("fwd" for every forward kind), ``launched`` the kernel's own kind
        self.kind, self.launched, self.cfg = ("fwd" if kind in FORWARDS else kind), kind, cfg
        self.args = args
        # contents at launch time (later launches may write the buffers)
        self.seen = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch of the test, in order. The fake forward writes 7.0 into all of lse
    (a kernel writes whole row tiles, padding rows included)."""
    out: list[Launch] = []

    class Recorder(dict):
        def get(self, key, default=None):
            kind, cfg = key
            assert isinstance(cfg, KernelConfig)

            def kernel(*args):
                out.append(Launch(kind, cfg, args))
                if kind in FORWARDS:
                    args[-1].fill_(7.0)
                elif kind == "fwd_o32":  # lse, then the fp32 O
                    args[-2].fill_(7.0)

            return kernel

    monkeypatch.setattr(registry, "_cache", Recorder())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dense, "_sm_count", lambda index: 132)
    return out


def _arch(monkeypatch, arch):
    monkeypatch.setattr(config, "_arch_of_index", lambda index: arch)


def same(a, b) -> bool:
    """The same tensor memory, seen the same way (the launch got the caller's tensor in place)."""
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def check_buffer(t, shape, dtype=torch.float32):
    assert isinstance(t, torch.Tensor)
    assert tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.is_contiguous(), (t.shape, t.dtype, shape)


def check_scalar(x, value, typ):
    assert type(x) is typ and x == value, (x, value)


def _rows(n):
    return max(128, -(-n // 128) * 128)


# ----------------------------------------------------------------------------------------------
# padded layouts (bhsd, bshd)

DENSE = [
    # b, h, hk, sq, skv, d, window, layout, sinks
    (2, 4, 2, 200, 200, 64, 16, "bhsd", True),  # padding rows (200 -> 256)
    (1, 6, 3, 256, 300, 128, None, "bshd", True),  # no padding rows
    (2, 4, 1, 70, 70, 32, 5, "bshd", False),
]


def _dense_inputs(case, dtype=torch.float16):
    b, h, hk, sq, skv, d, window, layout, with_sinks = case
    g = torch.Generator().manual_seed(0)

    def shape(hh, s):
        return (b, hh, s, d) if layout == "bhsd" else (b, s, hh, d)

    q = torch.randn(shape(h, sq), generator=g).to(dtype)
    k = torch.randn(shape(hk, skv), generator=g).to(dtype)
    v = torch.randn(shape(hk, skv), generator=g).to(dtype)
    do = torch.randn(shape(h, sq), generator=g).to(dtype)
    sinks = torch.randn(h, generator=g) if with_sinks else None
    spec = validate_attention(q, k, v, sinks, window=window, causal=True, scale=None, layout=layout)
    return q, k, v, do, sinks, spec


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"{c[7]}-B{c[0]}-H{c[1]}-HK{c[2]}-N{c[3]}x{c[4]}-D{c[5]}-W{c[6]}")
def test_dense_forward_launch(monkeypatch, launches, arch, case):
    _arch(monkeypatch, arch)
    q, k, v, do, sinks, spec = _dense_inputs(case)
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), False)
    assert cfg.arch == arch and cfg.layout == spec.layout
    window = NO_WINDOW if spec.window is None else spec.window
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    o, lse = dense.forward(dense.Plan(spec, cfg, window), q, k, v, sinks32)
    (fw,) = launches
    assert fw.kind == "fwd" and fw.cfg == cfg and len(fw.args) == 8
    # a window of at most 128 keys takes the windowed tiles where the group packs (config.fwd_window_tiles)
    assert fw.launched == ("fwd_window" if window <= config.WINDOW_TILES_MAX and config.fwd_windowed(cfg) else "fwd")
    a = fw.args
    for got, want in zip(a[:4], (q, k, v, sinks32)):
        assert same(got, want)
    check_scalar(a[4], window, int)
    check_scalar(a[5], float(spec.scale) * LOG2E, float)
    check_buffer(a[6], (*q.shape[:-1], spec.head_dim_v), q.dtype)
    check_buffer(a[7], (spec.batch, spec.heads, _rows(spec.seq_q)))
    assert same(o, a[6]) and same(lse, a[7])


@pytest.mark.parametrize("sinks", [True, False])
def test_dense_forward_through_the_op_zeroes_lse_padding(monkeypatch, launches, sinks):
    """``flashsink::fwd``'s CUDA implementation: lse rows past seq_q hold 0 (what the kernel left
    there is overwritten), the rows of the sequence are the kernel's."""
    _arch(monkeypatch, "sm_90a")
    for sq in (200, 256):
        case = (1, 4, 2, sq, sq, 64, 16, "bhsd", sinks)
        q, k, v, do, s, spec = _dense_inputs(case)
        o, lse = custom_ops._fwd_cuda(q, k, v, s, 16, True, spec.scale, "bhsd", False)
        assert lse.shape == (1, 4, _rows(sq))
        assert torch.all(lse[:, :, :sq] == 7.0) and torch.all(lse[:, :, sq:] == 0)
        fw = launches[-1]
        assert same(o, fw.args[6]) and same(lse, fw.args[7])
        if not sinks:
            check_buffer(fw.args[3], (4,))  # read by no kernel without sinks: only its shape matters


def test_decode_uses_the_split_forward(monkeypatch, launches):
    _arch(monkeypatch, "sm_90a")
    q, k, v, do, sinks, spec = _dense_inputs((2, 8, 2, 1, 700, 64, None, "bshd", True))
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), False)
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    o, lse = dense.forward(dense.Plan(spec, cfg, NO_WINDOW), q, k, v, sinks32)
    fw, merge = launches
    assert fw.kind == "fwd_split" and len(fw.args) == 7
    for got, want in zip(fw.args[:3], (q, k, v)):
        assert same(got, want)
    check_scalar(fw.args[3], NO_WINDOW, int)
    check_scalar(fw.args[4], float(spec.scale) * LOG2E, float)
    n_split = fw.args[5].shape[3]
    check_buffer(fw.args[5], (2, 8, 1, n_split, 64))
    check_buffer(fw.args[6], (2, 8, 1, n_split))
    # the merge kernel reads the partials and the sinks, writes o (q's layout) and the padded lse
    assert merge.kind == "merge_splits" and merge.cfg == cfg and len(merge.args) == 5
    assert same(merge.args[0], fw.args[5]) and same(merge.args[1], fw.args[6]) and same(merge.args[2], sinks32)
    check_buffer(merge.args[3], q.shape, q.dtype)
    check_buffer(merge.args[4], (2, 8, 128))
    assert same(o, merge.args[3]) and same(lse, merge.args[4])
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 8, 128)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("sinks", [True, False], ids=["sink", "nosink"])
def test_kvcache_launches(monkeypatch, launches, paged, sinks):
    """attention_kvcache: the paged forward then the merge, nothing else; the caller's cache,
    lengths and block table in place (a contiguous cache with the identity table [[0], [1], ..])."""
    from flashsink._validate_kvcache import validate_kvcache
    from flashsink.ops.launch import kvcache

    _arch(monkeypatch, "sm_90a")
    monkeypatch.setattr(kvcache, "_PLANS", {})  # plans hold the kernels: fetch the recorder's
    B, Sq, H, Hk, D = 3, 2, 16, 2, 64
    q = torch.randn(B, Sq, H, D, dtype=torch.bfloat16)
    kc = torch.randn(20, 16, Hk, D, dtype=torch.bfloat16) if paged else torch.randn(B, 300, Hk, D, dtype=torch.bfloat16)
    table = torch.randint(0, 20, (B, 7), dtype=torch.int32) if paged else None
    lens = torch.tensor([5, 100, 1], dtype=torch.int32)
    s = torch.randn(H, dtype=torch.bfloat16) if sinks else None
    spec = validate_kvcache(q, kc, kc, lens, table, s, window=50, scale=None, return_lse=True, layout="bshd")
    o, lse = kvcache.kernel_attention_kvcache(spec, q, kc, kc, lens, table, s, return_lse=True)
    fw, merge = launches
    assert fw.kind == "fwd_kvcache" and merge.kind == "merge_splits" and fw.cfg == merge.cfg
    assert fw.cfg.layout == "bshd" and fw.cfg.causal and fw.cfg.has_sinks == sinks and fw.cfg.groups == 8
    assert len(fw.args) == 9
    for got, want in zip(fw.args[:3], (q, kc, kc)):
        assert same(got, want)
    if paged:
        assert same(fw.args[3], table)
    else:
        assert torch.equal(fw.args[3], torch.arange(B, dtype=torch.int32).view(B, 1))
    assert same(fw.args[4], lens)
    check_scalar(fw.args[5], 50, int)
    check_scalar(fw.args[6], spec.scale * LOG2E, float)
    n_split = fw.args[7].shape[3]
    check_buffer(fw.args[7], (B, H, Sq, n_split, D))
    check_buffer(fw.args[8], (B, H, Sq, n_split))
    assert same(merge.args[0], fw.args[7]) and same(merge.args[1], fw.args[8])
    check_buffer(merge.args[2], (H,))
    if sinks:
        assert torch.equal(merge.args[2], s.float())
    check_buffer(merge.args[3], (B, Sq, H, D), torch.bfloat16)
    check_buffer(merge.args[4], (B, H, Sq))
    assert same(o, merge.args[3]) and same(lse, merge.args[4])


def _check_backward(launches, cfg, spec, t, lse, dlse, sinks32, result, seq_args, stat_shape, rows_q):
    """The preprocess / bwd / (dq | postprocess) launches of one backward. ``seq_args(kind)``: the
    launch arguments between the inputs and ``window`` (cu_seqlens and the longest sequence for
    thd, nothing for the padded layouts); ``rows_q``: the rows of dlse (seq_q, or total_q).
    ``t``: q, k, v, do, o (o None in strict mode)."""
    q, k, v, do, o = t
    window = NO_WINDOW if spec.window is None else spec.window
    scale = float(spec.scale)
    kinds = [x.kind for x in launches]
    assert kinds == (["preprocess", "bwd", "dq"] if cfg.deterministic else ["preprocess", "bwd", "postprocess"])
    assert all(x.cfg == cfg for x in launches)
    pre, main, last = launches

    # strict: preprocess(q, k, v, do, lse, dlse_padded, sinks32, [seq args], window, scale, delta, dsink, dsink_part,
    #                    [dq_acc])
    # fast:   preprocess(o, do, lse, dlse_padded, sinks32, [seq args], delta, dsink, dsink_part, [dq_acc])
    # (dq_acc, the main backward's dQ accumulator, outside deterministic mode: the preprocess zeroes it)
    s = seq_args("preprocess")
    a, seen = pre.args, pre.seen
    inputs = (q, k, v, do, lse) if cfg.precision == "strict" else (o, do, lse)
    n_in = len(inputs)
    n_acc = 0 if cfg.deterministic else 1
    assert len(a) == n_in + (7 if cfg.precision == "strict" else 5) + len(s) + n_acc
    for got, want in zip(a[:n_in], inputs):
        assert same(got, want)
    check_buffer(a[n_in], stat_shape)
    want_dlse = torch.zeros(stat_shape)
    if dlse is not None:
        want_dlse[..., :rows_q] = dlse
    assert torch.equal(seen[n_in], want_dlse)
    assert same(a[n_in + 1], sinks32)
    for got, want in zip(a[n_in + 2:n_in + 2 + len(s)], s):
        assert same(got, want) if isinstance(want, torch.Tensor) else (type(got) is int and got == want)
    i = n_in + 2 + len(s)
    if cfg.precision == "strict":
        check_scalar(a[i], window, int)
        check_scalar(a[i + 1], scale, float)
        i += 2
    delta, dsink, dsink_part = a[i], a[i + 1], a[i + 2]
    check_buffer(delta, stat_shape)
    check_buffer(dsink, (spec.heads,))
    n_part = math.ceil(spec.seq_q / config.pre_tiles(cfg).block_m) if cfg.deterministic else 1
    check_buffer(dsink_part, (spec.batch, spec.heads, n_part))
    if cfg.deterministic:
        assert torch.all(seen[i + 2] == 0)  # per-program partials: summed over every slot afterwards
    elif cfg.has_sinks:
        assert torch.all(seen[i + 1] == 0)  # atomically accumulated (without sinks no kernel touches it)

    dq, dk, dv, dsink_out = result
    # bwd(q, k, v, do, lse, delta, [seq args], window, scale, [dq_acc], dk, dv)
    s = seq_args("bwd")
    a = main.args
    for got, want in zip(a[:5], (q, k, v, do, lse)):
        assert same(got, want)
    assert same(a[5], delta)
    for got, want in zip(a[6:6 + len(s)], s):
        assert same(got, want) if isinstance(want, torch.Tensor) else (type(got) is int and got == want)
    i = 6 + len(s)
    check_scalar(a[i], window, int)
    check_scalar(a[i + 1], scale, float)
    if cfg.deterministic:
        assert len(a) == i + 4
        dk_buf, dv_buf = a[i + 2], a[i + 3]
        # dq(q, k, v, do, lse, delta, [seq args], window, scale, dq)
        s = seq_args("dq")
        b = last.args
        assert len(b) == 9 + len(s)
        for got, want in zip(b[:5], (q, k, v, do, lse)):
            assert same(got, want)
        assert same(b[5], delta)
        for got, want in zip(b[6:6 + len(s)], s):
            assert same(got, want) if isinstance(want, torch.Tensor) else (type(got) is int and got == want)
        check_scalar(b[6 + len(s)], window, int)
        check_scalar(b[7 + len(s)], scale, float)
        dq_buf = b[8 + len(s)]
        if cfg.has_sinks:
            assert torch.equal(dsink_out, dsink_part.sum(dim=(0, 2)))
    else:
        assert len(a) == i + 5
        dq_acc, dk_buf, dv_buf = a[i + 2], a[i + 3], a[i + 4]
        check_buffer(dq_acc, (*stat_shape, spec.head_dim))
        # accumulated with atomics, from zeros the preprocess writes (the host fills nothing)
        assert same(pre.args[-1], dq_acc)
        # postprocess(dq_acc, dq)
        assert len(last.args) == 2 and same(last.args[0], dq_acc)
        dq_buf = last.args[1]
        if cfg.has_sinks:
            assert same(dsink_out, dsink)
    check_buffer(dq_buf, q.shape, q.dtype)
    check_buffer(dk_buf, k.shape, k.dtype)
    check_buffer(dv_buf, v.shape, v.dtype)
    assert same(dq, dq_buf) and same(dk, dk_buf) and same(dv, dv_buf)
    if not cfg.has_sinks:
        assert dsink_out is None


def _fake_o(q, spec):
    """A forward output for the fast backward to read (q's layout, D_v)."""
    return torch.randn((*q.shape[:-1], spec.head_dim_v), generator=torch.Generator().manual_seed(5)).to(q.dtype)


@pytest.mark.parametrize("precision", ["fast", "strict"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"{c[7]}-B{c[0]}-H{c[1]}-HK{c[2]}-N{c[3]}x{c[4]}-D{c[5]}-W{c[6]}")
def test_dense_backward_launches(monkeypatch, launches, arch, case, with_dlse, deterministic, precision):
    _arch(monkeypatch, arch)
    q, k, v, do, sinks, spec = _dense_inputs(case)
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), deterministic, precision)
    assert cfg.precision == precision
    o = _fake_o(q, spec) if precision == "fast" else None
    window = NO_WINDOW if spec.window is None else spec.window
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    rows = _rows(spec.seq_q)
    lse = torch.randn(spec.batch, spec.heads, rows)
    dlse = torch.randn(spec.batch, spec.heads, spec.seq_q) if with_dlse else None
    result = dense.backward(dense.Plan(spec, cfg, window), do, q, k, v, o, lse, dlse, sinks32)
    _check_backward(launches, cfg, spec, (q, k, v, do, o), lse, dlse, sinks32, result, lambda kind: (),
                    (spec.batch, spec.heads, rows), spec.seq_q)


@pytest.mark.parametrize("case", DENSE[:2], ids=lambda c: f"{c[7]}-B{c[0]}-H{c[1]}-HK{c[2]}-N{c[3]}x{c[4]}")
def test_split_backward_launches(monkeypatch, launches, case):
    """The split main backward (a GQA group's query heads over several programs per KV tile): the
    ``bwd_split`` kernel gets zeroed fp32 dK/dV accumulators of [B, H_kv, rows_kv, D], the dQ
    accumulator the preprocess zeroes, and the postprocess casts dQ, dK and dV, in that order, into
    the returned gradients."""
    _arch(monkeypatch, "sm_90a")
    monkeypatch.setattr(dense, "_use_split", lambda cfg, spec, window, total_q=None: True)
    q, k, v, do, sinks, spec = _dense_inputs(case)
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), False, "fast")
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    lse = torch.randn(spec.batch, spec.heads, _rows(spec.seq_q))
    dq, dk, dv, _ = dense.backward(dense.Plan(spec, cfg, NO_WINDOW), do, q, k, v, _fake_o(q, spec), lse, None, sinks32)
    assert [x.kind for x in launches] == ["preprocess", "bwd_split", "postprocess", "postprocess", "postprocess"]
    main = launches[1]
    dq_acc, dk_acc, dv_acc = main.args[-3:]
    kv_rows = (spec.batch, spec.kv_heads, _rows(spec.seq_kv), spec.head_dim)
    check_buffer(dq_acc, (spec.batch, spec.heads, _rows(spec.seq_q), spec.head_dim))
    check_buffer(dk_acc, kv_rows)
    check_buffer(dv_acc, kv_rows)
    assert all(torch.all(t == 0) for t in main.seen[-2:])  # accumulated with atomics
    assert same(launches[0].args[-1], dq_acc)  # zeroed by the preprocess
    for post, acc, out in zip(launches[2:], (dq_acc, dk_acc, dv_acc), (dq, dk, dv)):
        assert len(post.args) == 2 and same(post.args[0], acc) and same(post.args[1], out)
    check_buffer(dk, k.shape, k.dtype)
    check_buffer(dv, v.shape, v.dtype)


def test_split_backward_is_chosen_for_long_rows(monkeypatch):
    """bwd_split runs where a KV tile sees at least BWD_SPLIT_MIN_ROWS rows and the configuration has
    a split (GQA, not deterministic, Hopper); windowed and short problems keep the unsplit kernel."""
    from flashsink.kernel_config import BWD_SPLIT_MIN_ROWS

    _arch(monkeypatch, "sm_90a")
    long_n = BWD_SPLIT_MIN_ROWS + 1
    for n, window, det, hk, d, want in ((long_n, None, False, 2, 256, True), (long_n, 128, False, 2, 256, False),
                                        (long_n - 2, None, False, 2, 256, False), (long_n, None, True, 2, 256, False),
                                        (long_n, None, False, 8, 256, False),
                                        # the ws kernel runs unsplit at D64, split head-major at D128
                                        # (config.bwd_split, bwd_head_major)
                                        (long_n, None, False, 2, 64, False), (long_n, None, False, 2, 128, True),
                                        (long_n - 2, None, False, 2, 128, False), (long_n, 128, False, 2, 128, False)):
        q, k, v, do, sinks, spec = _dense_inputs((1, 8, hk, n, n, d, window, "bhsd", True))
        cfg = dense.kernel_config(spec, torch.device("cuda", 0), det, "fast")
        assert dense._use_split(cfg, spec, dense.kernel_window(spec.window)) is want, (n, window, det, hk, d)


def test_split_backward_for_packed_batches(monkeypatch, launches):
    """Packed batches decide from max_seqlen_q capped by the packed rows: one sequence of
    BWD_SPLIT_MIN_ROWS among short ones splits (its KV tiles are the kernel's tail); short sequences
    with a loose max_seqlen_q above every row of the batch do not; a window keeps the unsplit kernel.
    A loose max_seqlen_q below the packed rows still splits (the host knows no real length without
    a sync; same gradients, only slower). The launch is the one dense.backward makes. (D256: the head
    dims of the ws kernel run unsplit.)"""
    from flashsink.kernel_config import BWD_SPLIT_MIN_ROWS as n

    _arch(monkeypatch, "sm_90a")
    for lens, max_q, window, want in (((5, n, 3, 0), n, None, True), ((5, n, 3, 0), n, 128, False),
                                      ((100,) * 6, 100, None, False), ((100,) * 6, 4 * n, None, False),
                                      ((300,) * 4, n, None, True)):
        q, k, v, do, sinks, cu_q, cu_k, spec = _varlen_inputs((lens, lens, 4, 2, 256, window, True))
        spec = validate_varlen(q, k, v, cu_q, cu_k, max_q, max_q, sinks, window=window, causal=True, scale=None)
        cfg = dense.kernel_config(spec, torch.device("cuda", 0), False, "fast")
        win = dense.kernel_window(spec.window)
        assert dense._use_split(cfg, spec, win, q.shape[0]) is want, (lens, max_q, window)
        launches.clear()
        lse = torch.randn(spec.heads, _varlen_rows(q.shape[0]))
        dense.backward(dense.Plan(spec, cfg, win, (cu_q, cu_k)), do, q, k, v, _fake_o(q, spec), lse, None,
                       dense.sinks_f32(sinks, 4, q.device))
        assert launches[1].kind == ("bwd_split" if want else "bwd"), (lens, max_q, window)


# ----------------------------------------------------------------------------------------------
# packed varlen (thd)

VARLEN = [
    # lengths q, lengths k, h, hk, d, window, sinks
    ((5, 0, 130, 1), (5, 7, 130, 1), 4, 2, 64, 16, True),
    ((64, 64), (100, 28), 6, 6, 128, None, False),
]


def _varlen_inputs(case, dtype=torch.bfloat16):
    lq, lk, h, hk, d, window, with_sinks = case
    g = torch.Generator().manual_seed(1)
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, h, d, generator=g).to(dtype)
    k = torch.randn(tk, hk, d, generator=g).to(dtype)
    v = torch.randn(tk, hk, d, generator=g).to(dtype)
    do = torch.randn(tq, h, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g) if with_sinks else None
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    spec = validate_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), sinks, window=window, causal=True, scale=None)
    return q, k, v, do, sinks, cu_q, cu_k, spec


def _varlen_rows(total):
    return _rows(total + 128)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", VARLEN, ids=["gqa-empty-seq", "mha-nosink"])
def test_varlen_forward_launch(monkeypatch, launches, arch, case):
    _arch(monkeypatch, arch)
    q, k, v, do, sinks, cu_q, cu_k, spec = _varlen_inputs(case)
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), False)
    assert cfg.layout == "thd"
    window = NO_WINDOW if spec.window is None else spec.window
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    o, lse = dense.forward(dense.Plan(spec, cfg, window, (cu_q, cu_k)), q, k, v, sinks32)
    (fw,) = launches
    assert fw.kind == "fwd" and len(fw.args) == 11
    a = fw.args
    for got, want in zip(a[:6], (q, k, v, sinks32, cu_q, cu_k)):
        assert same(got, want)
    check_scalar(a[6], spec.seq_q, int)
    check_scalar(a[7], window, int)
    check_scalar(a[8], float(spec.scale) * LOG2E, float)
    check_buffer(a[9], (q.shape[0], spec.heads, spec.head_dim_v), q.dtype)
    check_buffer(a[10], (spec.heads, _varlen_rows(q.shape[0])))
    assert same(o, a[9]) and same(lse, a[10])


@pytest.mark.parametrize("precision", ["fast", "strict"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", VARLEN, ids=["gqa-empty-seq", "mha-nosink"])
def test_varlen_backward_launches(monkeypatch, launches, arch, case, with_dlse, deterministic, precision):
    _arch(monkeypatch, arch)
    q, k, v, do, sinks, cu_q, cu_k, spec = _varlen_inputs(case)
    cfg = dense.kernel_config(spec, torch.device("cuda", 0), deterministic, precision)
    o = _fake_o(q, spec) if precision == "fast" else None
    window = NO_WINDOW if spec.window is None else spec.window
    sinks32 = dense.sinks_f32(sinks, spec.heads, q.device)
    rows = _varlen_rows(q.shape[0])
    lse = torch.randn(spec.heads, rows)
    dlse = torch.randn(spec.heads, q.shape[0]) if with_dlse else None
    result = dense.backward(dense.Plan(spec, cfg, window, (cu_q, cu_k)), do, q, k, v, o, lse, dlse, sinks32)

    def seq_args(kind):
        return (cu_q, cu_k, spec.seq_kv if kind == "bwd" else spec.seq_q)

    _check_backward(launches, cfg, spec, (q, k, v, do, o), lse, dlse, sinks32, result, seq_args,
                    (spec.heads, rows), q.shape[0])


ROUTES = ["ops", "eager"]


@contextlib.contextmanager
def _cuda_impls_on_cpu(route, **impls):
    """For the ops route, the ops' CPU kernels are their CUDA implementations inside the block (a scoped
    library). The eager route gets none: it must launch without the ops (else nothing is recorded)."""
    if route != "ops":
        yield
        return
    with torch.library._scoped_library("flashsink", "IMPL") as lib:
        for name, fn in impls.items():
            lib.impl(name, fn, "CPU")
        yield


@pytest.fixture
def route(request, monkeypatch):
    """"ops": the custom ops (what a torch.compile trace runs); "eager": attention._Attention, the
    autograd.Function CUDA tensors take eagerly (turned on here for CPU tensors)."""
    if request.param == "eager":
        monkeypatch.setattr(attention, "_eager", lambda q: True)
    return request.param


@pytest.mark.parametrize("route", ROUTES, indirect=True)
@pytest.mark.parametrize("precision", ["fast", "strict"])
def test_varlen_end_to_end_through_autograd(monkeypatch, launches, precision, route):
    """``attention.kernel_attention_varlen`` (what ``flashsink.attention_varlen`` runs on CUDA):
    forward and backward launches through ``flashsink::varlen_fwd`` / ``varlen_bwd`` and their
    autograd formula, or (eagerly) through ``attention._Attention``; the returned lse sliced to the
    packed rows, gradients the backward's buffers (dsink in the sinks' dtype). Fast mode hands the
    forward's o to the preprocess, strict q, k, v.

    On CPU tensors the ops dispatch to their reference implementation, so for this test only (a
    scoped library, removed on exit) the ops' CPU kernels are their CUDA implementations."""
    _arch(monkeypatch, "sm_90a")
    q, k, v, do, sinks, cu_q, cu_k, spec = _varlen_inputs(VARLEN[0])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks.to(torch.bfloat16))]
    spec = validate_varlen(*leaves[:3], cu_q, cu_k, spec.seq_q, spec.seq_kv, leaves[3], window=16, causal=True,
                           scale=None)
    with _cuda_impls_on_cpu(route, varlen_fwd=custom_ops._varlen_fwd_cuda, varlen_bwd=custom_ops._varlen_bwd_cuda):
        o, lse = attention.kernel_attention_varlen(spec, *leaves[:3], cu_q, cu_k, leaves[3], return_lse=True,
                                                    pad_head_dims=True, precision=precision)
        assert [x.kind for x in launches] == ["fwd"]
        fw = launches[0]
        assert fw.cfg.layout == "thd" and fw.cfg.has_sinks
        assert same(fw.args[4], cu_q) and same(fw.args[5], cu_k)
        assert same(o, fw.args[9])
        assert lse.shape == (4, q.shape[0]) and torch.all(lse == 7.0)
        assert lse.data_ptr() == fw.args[10].data_ptr()  # a view of the kernel's lse, not a copy
        grads = torch.autograd.grad(o, leaves, do)
        assert [x.kind for x in launches] == ["fwd", "preprocess", "bwd", "postprocess"]
        pre = launches[1]
        lse_padded = fw.args[10]
        assert pre.cfg.precision == precision
        if precision == "fast":
            assert same(pre.args[0], fw.args[9])  # the forward's o, saved for the backward
            i_lse = 2
        else:
            assert all(same(a, b) for a, b in zip(pre.args[:3], launches[0].args[:3]))  # q, k, v
            i_lse = 4
        assert same(pre.args[i_lse], lse_padded)  # the forward's padded lse
        assert torch.all(pre.seen[i_lse][:, : q.shape[0]] == 7.0)
        if route == "ops":  # the op's output contract: padding rows 0 (eagerly nobody sees them)
            assert torch.all(pre.seen[i_lse][:, q.shape[0]:] == 0)
        assert same(grads[0], launches[-1].args[1])
        assert same(grads[1], launches[2].args[-2]) and same(grads[2], launches[2].args[-1])
        assert grads[3].dtype == torch.bfloat16 and grads[3].shape == (4,)
    if route == "ops":
        # the scoped kernels are gone: the ops' CPU implementation is the reference again
        n = len(launches)
        attention.kernel_attention_varlen(spec, *leaves[:3], cu_q, cu_k, leaves[3])
        assert len(launches) == n


@pytest.mark.parametrize("route", ROUTES, indirect=True)
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("precision", ["fast", "strict"])
def test_dense_end_to_end_through_autograd(monkeypatch, launches, precision, with_lse, route):
    """``attention.kernel_attention`` (what ``flashsink.attention`` runs on CUDA, traced) with the ops' CPU kernels
    their CUDA implementations (a scoped library, as above): the fast backward's preprocess reads the
    forward's o; the strict one, eagerly on Hopper, the fp32 O of the forward ``fwd_o32``
    (``config.fwd_o32``), traced q, k, v; the other launches are the same in both modes."""
    _arch(monkeypatch, "sm_90a")
    q, k, v, do, sinks, spec = _dense_inputs(DENSE[0])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    with _cuda_impls_on_cpu(route, fwd=custom_ops._fwd_cuda, bwd=custom_ops._bwd_cuda):
        out = attention.kernel_attention(spec, *leaves, precision=precision, return_lse=with_lse)
        o, lse = out if with_lse else (out, None)
        assert same(o, launches[0].args[6])
        if with_lse:
            assert lse.shape == (2, 4, 200) and lse.data_ptr() == launches[0].args[7].data_ptr()
            dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
            grads = torch.autograd.grad((o, lse), leaves, (do, dlse))
        else:
            grads = torch.autograd.grad(o, leaves, do)
    o32 = precision == "strict" and route == "eager"
    assert [x.kind for x in launches] == (["fwd_o32", "preprocess_o32"] if o32 else ["fwd", "preprocess"]) + [
        "bwd", "postprocess"]
    main, post = launches[2], launches[3]
    assert same(grads[0], post.args[1]) and same(grads[1], main.args[-2]) and same(grads[2], main.args[-1])
    assert grads[3].dtype == sinks.dtype and grads[3].shape == (4,)
    i_dlse = 3 if precision == "fast" or o32 else 5
    want = torch.zeros(2, 4, 256)
    if with_lse:
        want[:, :, :200] = dlse
    assert torch.equal(launches[1].seen[i_dlse], want)  # the gradient of lse over the real rows, 0 past them
    assert {x.cfg.precision for x in launches} == {precision}
    fw, pre = launches[0], launches[1]
    assert same(pre.args[-1], main.args[-3])  # the dQ accumulator: zeroed by the preprocess, added into by bwd
    if precision == "fast":
        assert len(pre.args) == 9 and same(pre.args[0], fw.args[6]) and same(pre.args[2], fw.args[7])
    elif o32:  # the forward's fp32 O (its last argument, o's shape) and lse
        assert len(fw.args) == 9 and fw.args[8].dtype == torch.float32 and fw.args[8].shape == fw.args[6].shape
        assert len(pre.args) == 9 and same(pre.args[0], fw.args[8]) and same(pre.args[2], fw.args[7])
    else:
        assert len(pre.args) == 13 and all(same(a, b) for a, b in zip(pre.args[:3], fw.args[:3]))
        assert same(pre.args[4], fw.args[7])


@pytest.mark.l0
def test_shared_buffers_grow_and_keep_what_they_outgrow(monkeypatch):
    """dense._shared: the kept zero / unwritten buffers the backward hands its kernels. A view
    of the requested shape (contiguous), zeros for "zero"; a larger request grows the buffer and
    the outgrown one stays referenced (a kernel on another stream may still read it)."""
    monkeypatch.setattr(dense, "_SHARED", {})
    monkeypatch.setattr(dense, "_OUTGROWN", [])
    monkeypatch.setattr(dense, "_VIEWS", {})
    dev = torch.device("cpu")
    a = dense._zero_stat((2, 3, 128), dev)
    assert a.shape == (2, 3, 128) and a.is_contiguous() and a.dtype == torch.float32
    assert torch.equal(a, torch.zeros(2, 3, 128))
    b = dense._zero_stat((4, 128), dev)  # fits: the same storage
    assert b.data_ptr() == a.data_ptr() and not dense._OUTGROWN
    c = dense._zero_stat((4, 3, 128), dev)  # 2x: grows, the old one is kept
    assert c.shape == (4, 3, 128) and torch.equal(c, torch.zeros(4, 3, 128))
    assert len(dense._OUTGROWN) == 1 and dense._OUTGROWN[0].data_ptr() == a.data_ptr()
    u = dense._unwritten((2, 3, 1), dev)
    assert u.shape == (2, 3, 1) and u.data_ptr() != c.data_ptr()  # its own buffer, never the zeros
    # each shape is viewed once (a view costs host time): the same tensor again, even after the buffer grew
    assert dense._zero_stat((2, 3, 128), dev) is a and dense._unwritten((2, 3, 1), dev) is u
    assert torch.equal(a, torch.zeros(2, 3, 128))  # the outgrown buffer it views is kept, still zeros
    monkeypatch.setattr(dense, "MAX_VIEWS", 2)
    dense._unwritten((5,), dev)  # past MAX_VIEWS: the memo starts again
    assert len(dense._VIEWS) == 1 and dense._zero_stat((2, 3, 128), dev) is not a


@pytest.mark.parametrize("what", ["scale<=0", "no grad", "thd", "sm_80"])
def test_strict_keeps_delta_from_p_where_there_is_no_fp32_o(monkeypatch, launches, what):
    """Strict's eager forward keeps an fp32 O (``fwd_o32``, read by ``preprocess_o32``) only where
    ``config.fwd_o32`` has that kernel and the call can use it: a call with ``scale <= 0`` (no folded
    kernel), a forward without gradients, a packed batch and sm_80 run the usual forward, and a
    backward after it recomputes Delta from P and dP (the strict ``preprocess``, q, k, v first)."""
    _arch(monkeypatch, "sm_80" if what == "sm_80" else "sm_90a")
    monkeypatch.setattr(attention, "_eager", lambda q: True)
    q, k, v, do, sinks, spec = _dense_inputs(DENSE[0])
    leaves = [x.clone().requires_grad_(what != "no grad") for x in (q, k, v, sinks)]
    if what == "thd":
        b, s = q.shape[0], q.shape[2]
        flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3]).contiguous() for x in (q, k, v, do)]
        leaves = [x.requires_grad_(True) for x in flat[:3]] + [leaves[3]]
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
        spec = validate_varlen(*leaves[:3], cu, cu, s, s, leaves[3], window=16, causal=True, scale=None)
        o = attention.kernel_attention_varlen(spec, *leaves[:3], cu, cu, leaves[3], precision="strict")
        do = flat[3]
    else:
        if what == "scale<=0":
            spec = validate_attention(*leaves, window=16, causal=True, scale=-0.125, layout="bhsd")
        o = attention.kernel_attention(spec, *leaves, precision="strict")
    kinds = [x.launched for x in launches]
    assert "fwd_o32" not in kinds, kinds
    if what == "no grad":
        assert len(kinds) == 1 and not o.requires_grad
        return
    torch.autograd.grad(o, leaves, do)
    kinds = [x.launched for x in launches]
    assert "preprocess" in kinds and "preprocess_o32" not in kinds, kinds
    pre = launches[kinds.index("preprocess")]
    assert pre.args[0].dtype == q.dtype and len(pre.args) == 13 + (3 if what == "thd" else 0)  # q, k, v, ..., dq_acc
    if what == "scale<=0":
        assert kinds[0] == "fwd_unfolded"
