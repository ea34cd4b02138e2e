"""Every launch of the CUDA path against the kernel's own signature, on the CPU.

``test_launch_args.py`` writes the launch protocol out by hand; this file asks TileLang instead: the
kernel cache answers, for every (kind, config), a checker built from that kernel's ``PrimFunc``
(``keys.build_prim_func``, lowered to TIR only, no nvcc, no GPU), and every launch's tensors must
match its buffers: rank, every static dimension, dtype. A launch layer that sizes a buffer by the
problem's head dim where the kernel was built for the padded one (head dims 80, 96: run as 128) is
caught here, as the H200 caught it on 2026-12-03 ("input O shape[3] violates packed ABI constraint").

Paths covered: flashsink.attention eagerly (``attention._Attention``) and through the custom ops, the
varlen path, decode's split forward, the deterministic and the split main backward, native and padded
head dims, both precisions.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("tilelang", reason="the kernels' signatures come from TileLang's PrimFuncs")

from flashsink._validate import validate_attention, validate_varlen  # noqa: E402
from flashsink.ops.launch import attention, custom_ops, dense
from flashsink import kernel_config as config  # noqa: E402
from flashsink.ops.compiler import kinds  # noqa: E402
from flashsink.ops.compiler import compile as keys, registry  # noqa: E402
from flashsink.kernel_config import KernelConfig  # noqa: E402

from test_launch_args import _cuda_impls_on_cpu  # noqa: E402

pytestmark = pytest.mark.l0

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "int32": torch.int32}


@functools.lru_cache(maxsize=None)
def _signature(kind: str, cfg: KernelConfig):
    """(name, rank, static dims by axis, torch dtype) per buffer parameter; None for scalars."""
    func = keys.build_prim_func(kind, cfg)
    out = []
    for p in func.params:
        buf = func.buffer_map.get(p)
        if buf is None:
            out.append(None)
            continue
        dims = {i: int(s) for i, s in enumerate(buf.shape) if hasattr(s, "value")}
        out.append((buf.name, len(buf.shape), dims, _TORCH_DTYPES[str(buf.dtype)]))
    return out


@pytest.fixture
def checked(monkeypatch):
    """Every launch checked against its kernel's signature; returns the (kind, cfg) launched."""
    seen = []

    class Checker(dict):
        def get(self, key, default=None):
            kind, cfg = key

            def kernel(*args):
                sig = _signature(kind, cfg)
                assert len(args) == len(sig), f"{kind}: {len(args)} arguments, the kernel takes {len(sig)}"
                for i, (a, want) in enumerate(zip(args, sig)):
                    if want is None:
                        assert not isinstance(a, torch.Tensor), f"{kind} argument {i}: a tensor for a scalar"
                        continue
                    name, rank, dims, dtype = want
                    assert isinstance(a, torch.Tensor), f"{kind} {name}: {type(a).__name__}, not a tensor"
                    assert a.dim() == rank, f"{kind} {name}: rank {a.dim()}, the kernel's is {rank}"
                    for axis, n in dims.items():
                        assert a.shape[axis] == n, (
                            f"{kind} {name}: shape {list(a.shape)}, the kernel ({cfg.short()}) has {n} at axis {axis}")
                    assert a.dtype == dtype, f"{kind} {name}: {a.dtype}, the kernel's is {dtype}"
                if kind in (*kinds.forward_kinds(), "merge_splits"):
                    args[-1].fill_(0.5)  # lse: finite, so the backward's inputs are ordinary
                seen.append((kind, cfg))

            return kernel

    monkeypatch.setattr(registry, "_cache", Checker())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dense, "_sm_count", lambda index: 132)
    monkeypatch.setattr(config, "_arch_of_index", lambda index: "sm_90a")
    return seen


def _dense(b, h, hk, sq, skv, d, layout, window, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def shape(hh, s):
        return (b, hh, s, d) if layout == "bhsd" else (b, s, hh, d)

    q, k, v = (torch.randn(shape(n, s), generator=g).to(dtype) for n, s in ((h, sq), (hk, skv), (hk, skv)))
    sinks = torch.randn(h, generator=g)
    do = torch.randn(shape(h, sq), generator=g).to(dtype)
    return q, k, v, sinks, do


CASES = [
    # b, h, hk, sq, skv, d, layout, window
    (1, 8, 2, 333, 333, 80, "bhsd", None),   # padded head dim (80 -> 128)
    (2, 4, 2, 100, 100, 96, "bshd", 50),     # padded, bshd
    (1, 4, 4, 70, 70, 48, "bhsd", 16),       # padded to 64
    (1, 8, 8, 130, 130, 64, "bhsd", None),   # native
    (1, 16, 2, 2048, 2048, 80, "bhsd", None),  # long rows, padded (the unsplit ws main backward on Hopper)
    (1, 8, 2, 2048, 2048, 160, "bhsd", None),  # long rows: the split main backward (fast, D256's kernel), padded
    (2, 8, 2, 1, 4096, 80, "bshd", None),    # decode: the split-KV forward, padded
]


@pytest.mark.parametrize("route", ["eager", "ops"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("precision", ["fast", "strict"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-HK{c[2]}-N{c[3]}x{c[4]}-D{c[5]}-{c[6]}-W{c[7]}")
def test_dense_launches_match_the_kernels(monkeypatch, checked, case, precision, deterministic, route):
    b, h, hk, sq, skv, d, layout, window = case
    if route == "eager":
        monkeypatch.setattr(attention, "_eager", lambda q: True)
    q, k, v, sinks, do = _dense(b, h, hk, sq, skv, d, layout, window)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    spec = validate_attention(*leaves, window=window, causal=True, scale=None, layout=layout)
    with _cuda_impls_on_cpu(route, fwd=custom_ops._fwd_cuda, bwd=custom_ops._bwd_cuda):
        o = attention.kernel_attention(spec, *leaves, deterministic=deterministic, precision=precision)
        assert o.shape == q.shape
        grads = torch.autograd.grad(o, leaves, do)
    assert [tuple(g.shape) for g in grads] == [tuple(x.shape) for x in leaves]
    kinds = [kind for kind, _ in checked]
    # strict's eager training forward on Hopper keeps an fp32 O for its Delta pass (config.fwd_o32): the
    # kinds fwd_o32 and preprocess_o32, where the forward has them (not the split decode, not D256)
    o32 = (precision == "strict" and route == "eager" and sq > 1
           and config.fwd_o32(dense.kernel_config(spec, q.device, deterministic, precision)))
    if o32:
        assert kinds[:2] == ["fwd_o32", "preprocess_o32"] and "preprocess" not in kinds, kinds
    else:
        assert kinds[0] in ("fwd", "fwd_window", "fwd_split") and "preprocess" in kinds, kinds
    if sq >= 2048 and precision == "fast" and not deterministic and d > 128:
        assert "bwd_split" in kinds  # the case meant to cover it does
    if sq == 1:
        assert kinds[:2] == ["fwd_split", "merge_splits"]


VARLEN = [
    # lengths, h, hk, d, window
    ((37, 0, 150, 64), 8, 2, 80, 32),
    ((300, 5), 4, 4, 96, None),
    ((129, 64), 4, 2, 64, 16),
]


@pytest.mark.parametrize("route", ["eager", "ops"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("precision", ["fast", "strict"])
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"L{'-'.join(map(str, c[0]))}-H{c[1]}-HK{c[2]}-D{c[3]}-W{c[4]}")
def test_varlen_launches_match_the_kernels(monkeypatch, checked, case, precision, deterministic, route):
    lens, h, hk, d, window = case
    if route == "eager":
        monkeypatch.setattr(attention, "_eager", lambda q: True)
    g = torch.Generator().manual_seed(1)
    total = sum(lens)
    q = torch.randn(total, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(total, hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(total, hk, d, generator=g).to(torch.bfloat16)
    do = torch.randn(total, h, d, generator=g).to(torch.bfloat16)
    sinks = torch.randn(h, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    spec = validate_varlen(*leaves[:3], cu, cu, max(lens), max(lens), leaves[3], window=window, causal=True,
                           scale=None)
    with _cuda_impls_on_cpu(route, varlen_fwd=custom_ops._varlen_fwd_cuda, varlen_bwd=custom_ops._varlen_bwd_cuda):
        o = attention.kernel_attention_varlen(spec, *leaves[:3], cu, cu, leaves[3], pad_head_dims=True,
                                              deterministic=deterministic, precision=precision)
        assert o.shape == q.shape
        grads = torch.autograd.grad(o, leaves, do)
    assert [tuple(x.shape) for x in grads] == [tuple(x.shape) for x in leaves]
    assert [kind for kind, _ in checked][0] in ("fwd", "fwd_window")


def test_the_checker_catches_a_wrong_head_dim(checked):
    """The checker itself: a buffer sized for the problem's head dim (80) where the kernel runs 128."""
    cfg = KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=128, head_dim_v=128, groups=2, causal=True,
                       has_sinks=True, layout="bhsd", precision="fast", deterministic=False)
    q, k, v, sinks, _ = _dense(1, 4, 2, 64, 64, 128, "bhsd", None)
    o = torch.empty(1, 4, 64, 80, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 128)
    with pytest.raises(AssertionError, match="axis 3"):
        registry._cache.get(("fwd", cfg))(q, k, v, sinks, 1 << 30, 0.1, o, lse)
