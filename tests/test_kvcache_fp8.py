"""attention_kvcache with an fp8 cache (float8_e4m3fn K and V, float32 ``k_scale`` / ``v_scale`` per tensor
or per KV head; issue 53, item 1). On the CPU: the public function and the reference against the float64
formula on the dequantized cache (``float(k) * k_scale``) under the fast gate, paged and contiguous, both
layouts, decode and prefill chunks, sinks and windows; every refusal by its message. On a GPU (``-m gpu``):
the CUDA route (the cache dequantized on the device, then the fp16/bf16 kernels) against the same formula,
and bad scales as NaN. Results of ``torch.empty`` are NaN (conftest), so an unwritten element fails."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch

import flashsink
from flashsink import reference
from flashsink.testing import assert_fast, dtype_name

from test_reference import eager_attention  # the independent float64 formula

FP8 = torch.float8_e4m3fn
BF16, F16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Fp8Case:
    lengths: tuple
    page_size: int | None  # None: a contiguous cache
    scales: str  # "tensor" ([1]), "scalar" ([]), "head" ([H_kv])
    seq_q: int = 1
    window: int | None = None
    sinks: bool = True
    dtype: torch.dtype = BF16
    layout: str = "bshd"
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16

    def __str__(self):
        pages = "contig" if self.page_size is None else f"P{self.page_size}"
        return (f"B{len(self.lengths)}-H{self.heads}-HK{self.kv_heads}-Q{self.seq_q}-K{max(self.lengths)}-"
                f"D{self.head_dim}-{pages}-W{self.window}-{'sink' if self.sinks else 'nosink'}-{self.scales}-"
                f"{dtype_name(self.dtype)}-{self.layout}")


def make_problem(c: Fp8Case, *, seed=0, device="cpu"):
    """Random q and a random fp8 cache (values of every size e4m3 holds, its unused rows too), random
    scales, a random block table (pages shuffled, garbage past each row's used pages). Returns the call's
    arguments (in ``c.layout``) and the bshd cache with its table, for the formula."""
    g = torch.Generator().manual_seed(seed)
    B, HK, D = len(c.lengths), c.kv_heads, c.head_dim
    if c.page_size is None:
        shape, table = (B, max(c.lengths) + 3, HK, D), None
    else:
        used = [-(-n // c.page_size) for n in c.lengths]
        num_pages = sum(used) + 3
        table = torch.randint(-10**6, 10**6, (B, max(used) + 2), generator=g, dtype=torch.int32)
        perm = torch.randperm(num_pages, generator=g).to(torch.int32)
        start = 0
        for b, u in enumerate(used):
            table[b, :u] = perm[start : start + u]
            start += u
        shape = (num_pages, c.page_size, HK, D)
    kc, vc = ((torch.randn(shape, generator=g) * torch.rand(shape, generator=g).mul(6).exp2()).to(FP8) for _ in "kv")
    n_scales = {"tensor": (1,), "scalar": (), "head": (HK,)}[c.scales]
    k_scale, v_scale = (torch.rand(n_scales, generator=g) * 0.2 + 0.01 for _ in "kv")
    q = torch.randn(B, c.seq_q, c.heads, D, generator=g).to(c.dtype)
    sinks = torch.rand(c.heads, generator=g) * 4 - 2 if c.sinks else None
    lens = torch.tensor(c.lengths, dtype=torch.int32)
    bshd = dict(k_cache=kc, v_cache=vc, block_table=table, k_scale=k_scale, v_scale=v_scale)
    if c.layout == "bhsd":
        q, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = dict(q=on(q), k_cache=on(kc), v_cache=on(vc), cache_seqlens=on(lens), block_table=on(table),
                sinks=on(sinks), window=c.window, layout=c.layout, k_scale=on(k_scale), v_scale=on(v_scale))
    return args, bshd


def fp64_formula(c: Fp8Case, args, bshd):
    """o ``[B, S_q, H, D]`` (bshd) and lse ``[B, H, S_q]`` in float64: each row's keys gathered key by key,
    dequantized as ``float64(k) * float64(k_scale)`` of its KV head, then the eager formula with the
    queries at the last S_q positions of the row."""
    q = args["q"].cpu().double()
    q = q.transpose(1, 2) if c.layout == "bshd" else q  # [B, H, S_q, D]
    sinks = None if args["sinks"] is None else args["sinks"].cpu().double()
    outs, lses = [], []
    for b, n in enumerate(c.lengths):
        j = torch.arange(n)
        page = torch.full((n,), b) if c.page_size is None else bshd["block_table"][b, j // c.page_size].long()
        slot = j if c.page_size is None else j % c.page_size
        k, v = (bshd[f"{x}_cache"][page, slot].double() * bshd[f"{x}_scale"].double().reshape(-1, 1) for x in "kv")
        o, lse = eager_attention(q[b : b + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None], sinks,
                                 positions=torch.arange(c.seq_q) + n - c.seq_q, window=c.window, causal=True,
                                 scale=c.head_dim ** -0.5)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def lowp(c: Fp8Case, args):
    """The reference in q's dtype on the cache dequantized by the test: o (c.layout) and lse, on the CPU."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for x in "kv":
        scale = cpu.pop(f"{x}_scale").double().reshape(-1, 1)
        if c.layout == "bhsd":  # [.., H_kv, S, D]: the scale of KV head h on its rows
            scale = scale.reshape(-1, 1, 1)
        cpu[f"{x}_cache"] = (cpu[f"{x}_cache"].double() * scale).to(c.dtype)
    return reference.attention_kvcache(**cpu, return_lse=True, compute_dtype=c.dtype)


def check_against_formula(c: Fp8Case, args, bshd, o, lse):
    """``o``/``lse`` (any device, c.layout) against the formula under the fast gate; lowp: what plain PyTorch
    gets in q's dtype, the reference computing in that dtype on the cache dequantized here (in float64, rounded
    once to q's dtype), so that no fp8 code of flashsink's widens the bound."""
    want_o, want_lse = fp64_formula(c, args, bshd)
    low_o, low_lse = lowp(c, args)
    o = o.cpu().transpose(1, 2) if c.layout == "bhsd" else o.cpu()
    low_o = low_o.transpose(1, 2) if c.layout == "bhsd" else low_o
    assert o.dtype == c.dtype and lse.dtype == torch.float32 and o.isfinite().all()
    assert_fast("o", o, want_o, c.dtype, lowp=low_o)
    assert_fast("lse", lse.cpu(), want_lse, c.dtype, lowp=low_lse)


def _cpu_cases():
    """Every page layout x scale kind x decode / chunk x window, with sinks, dtype and layout turning over."""
    cases, i = [], 0
    for page_size, lengths in ((16, (70, 33, 16, 6)), (5, (41, 7)), (1, (9, 12)), (None, (50, 8, 23))):
        for scales in ("tensor", "scalar", "head"):
            for seq_q in (1, 6):
                for window in (None, 7):
                    cases.append(Fp8Case(lengths, page_size, scales, seq_q, window, sinks=i % 3 != 1,
                                         dtype=(BF16, F16)[i % 2], layout=("bshd", "bhsd")[(i // 2) % 2]))
                    i += 1
    cases.append(Fp8Case((64, 30), 16, "head", 4, heads=8, kv_heads=8))  # MHA: a scale per head
    cases.append(Fp8Case((64, 30), 16, "head", 3, heads=6, kv_heads=1))  # MQA: [H_kv] = [1]
    return cases


@pytest.mark.l0
@pytest.mark.parametrize("c", _cpu_cases(), ids=str)
def test_fp8_cache_against_the_fp64_formula(c):
    args, bshd = make_problem(c)
    o, lse = flashsink.attention_kvcache(**args, return_lse=True)
    check_against_formula(c, args, bshd, o, lse)
    o_ref, lse_ref = reference.attention_kvcache(**args, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)  # off CUDA the public function is the reference


@pytest.mark.l0
def test_per_head_scales_reach_their_heads():
    """Per KV head scales far apart (1/64 and 64): a head read with the other head's scale is off by 4096x
    in its scores, so only the right mapping (query head h reads KV head h // groups) passes."""
    c = Fp8Case((40, 17), 8, "head", 2, window=11)
    args, bshd = make_problem(c, seed=5)
    for x in "kv":
        bshd[f"{x}_scale"].copy_(torch.tensor([1 / 64, 64.0]))
    o, lse = flashsink.attention_kvcache(**args, return_lse=True)
    check_against_formula(c, args, bshd, o, lse)


@pytest.mark.l0
def test_same_answer_as_a_dequantized_cache():
    """The fp8 call is the call on the cache dequantized in float32 (with q in float32), rounded to q's dtype:
    what 'the reference dequantizes and runs the dense reference' means, to the bit."""
    c = Fp8Case((70, 33, 16, 6), 16, "head", 6, window=7)
    args, bshd = make_problem(c, seed=2)
    o, lse = flashsink.attention_kvcache(**args, return_lse=True)
    deq = {x: args[f"{x}_cache"].float() * args[f"{x}_scale"].reshape(-1, 1) for x in "kv"}
    want_o, want_lse = reference.attention_kvcache(args["q"].float(), deq["k"], deq["v"], args["cache_seqlens"],
                                                   block_table=args["block_table"], sinks=args["sinks"],
                                                   window=c.window, layout=c.layout, return_lse=True)
    assert torch.equal(o, want_o.to(c.dtype)) and torch.equal(lse, want_lse)


@pytest.mark.l0
def test_meta_tensors_and_the_op():
    """Meta tensors take the op's fake (shapes and dtypes); the op itself takes the scales last."""
    c = Fp8Case((20, 9), 4, "head", 3)
    args, _ = make_problem(c)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    o, lse = flashsink.attention_kvcache(**meta, return_lse=True)
    assert o.device.type == "meta" and o.shape == args["q"].shape and o.dtype == BF16 and lse.dtype == torch.float32
    a = args
    o, lse = torch.ops.flashsink.kvcache_fwd(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"],
                                             a["sinks"], None, 0.25, "bshd", a["k_scale"], a["v_scale"])
    want_o, want_lse = flashsink.attention_kvcache(**{**a, "window": None}, scale=0.25, return_lse=True)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


@pytest.mark.l0
@pytest.mark.parametrize("dtype", [BF16, F16], ids=dtype_name)
def test_the_cuda_routes_dequantization_on_the_cpu(dtype):
    """What the CUDA route runs before the kernels, on the CPU: every e4m3 value times a per-head scale,
    written in q's dtype within its rounding of the float64 product (a float32 product rounded again: at
    most one ulp of the dtype), and NaN in the heads whose scale is not finite and > 0."""
    from flashsink.ops.launch.kvcache import _nan_unless_positive

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)  # all 256 codes, NaN included
    cache = every.reshape(1, 4, 1, 64).expand(3, 4, 6, 64).contiguous()  # [pages, page_size, H_kv, D]
    scale = torch.tensor([0.37, 3e-3, 1.0, 0.0, float("nan"), -2.0])
    got = reference.dequantize_kvcache(cache, _nan_unless_positive(scale), dtype)
    assert got.dtype == dtype and got.shape == cache.shape and got.is_contiguous()
    want = cache.double() * scale.double().reshape(-1, 1)
    ok = slice(0, 3)
    fin = want[:, :, ok].isfinite()
    ulp = torch.finfo(dtype).eps * want[:, :, ok].abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got[:, :, ok].double() - want[:, :, ok]).abs()[fin] <= ulp[fin]).all()
    assert torch.equal(got[:, :, ok].isnan(), want[:, :, ok].isnan())  # e4m3's own NaN codes stay NaN
    assert got[:, :, 3:].isnan().all()


@pytest.mark.parametrize("scales", ["tensor", "head"])
def test_opcheck_and_compiled_cpu(scales):
    """The op with the scales (opcheck: fake, AOT dispatch, autograd registration), and ``attention_kvcache`` compiled
    (fullgraph, dynamic) over two calls with new lengths, batch and pages: one graph, the eager result to the bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    first = Fp8Case((50, 17, 3), 12, scales, 4, window=20)
    args, _ = make_problem(first, seed=1)
    op_args = (*(args[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "sinks")), 20, 0.3,
               "bshd", args["k_scale"], args["v_scale"])
    # test_schema compares the inputs before and after with a product, which torch has not for fp8 tensors
    torch.library.opcheck(torch.ops.flashsink.kvcache_fwd.default, op_args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flashsink.attention_kvcache, backend=counter, fullgraph=True, dynamic=True)
    for i, c in enumerate((first, Fp8Case((70, 9, 2, 40, 100), 7, scales, 6, window=20))):
        args, _ = make_problem(c, seed=i)
        with torch.inference_mode():
            got, want = compiled(**args, return_lse=True), flashsink.attention_kvcache(**args, return_lse=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counter.frame_count == 1


# -------------------------------------------------------------------------------------------------
# refusals, each by its message: the public function, the reference and the op


def _op(q, k_cache, v_cache, cache_seqlens, *, block_table=None, sinks=None, window=None, layout="bshd",
        k_scale=None, v_scale=None):
    return torch.ops.flashsink.kvcache_fwd(q, k_cache, v_cache, cache_seqlens, block_table, sinks, window, 0.25,
                                           layout, k_scale, v_scale)


def _good():
    args, _ = make_problem(Fp8Case((10, 30), 16, "head"))
    return args


_NEED = r"a float32 tensor of shape \[1\] \(one scale for the tensor\) or \[H_kv\] = \[2\]"
_VALUE = "must be finite and > 0"
_BAD_FP8 = [
    ("v_cache", lambda a: a["v_cache"].to(BF16), ValueError,
     "k_cache and v_cache must share one dtype, got k_cache torch.float8_e4m3fn, v_cache torch.bfloat16"),
    ("k_cache", lambda a: a["k_cache"].to(BF16), ValueError,
     "k_cache and v_cache must share one dtype, got k_cache torch.bfloat16, v_cache torch.float8_e4m3fn"),
    ("q", lambda a: a["q"].to(FP8), NotImplementedError, "q has dtype torch.float8_e4m3fn: fp8 queries are not"),
    ("q", lambda a: a["q"].float(), NotImplementedError, "cache q must be bfloat16 or float16, got torch.float32"),
    ("k_cache", lambda a: a["k_cache"].to(torch.float8_e5m2), ValueError, "must share one dtype"),
    ("both", lambda a: {"k_cache": a["k_cache"].to(torch.float8_e5m2), "v_cache": a["v_cache"].to(torch.float8_e5m2)},
     NotImplementedError, "the fp8 caches supported are torch.float8_e4m3fn"),
    ("k_scale", lambda a: None, ValueError, "k_scale is required with a torch.float8_e4m3fn cache"),
    ("v_scale", lambda a: None, ValueError, "v_scale is required with a torch.float8_e4m3fn cache"),
    ("k_scale", lambda a: 0.5, TypeError, "k_scale must be a float32 tensor of shape .* got float"),
    ("v_scale", lambda a: a["v_scale"].double(), TypeError, "v_scale must have dtype float32, got torch.float64"),
    ("k_scale", lambda a: a["k_scale"].bfloat16(), TypeError, "k_scale must have dtype float32, got torch.bfloat16"),
    ("k_scale", lambda a: torch.ones(3), ValueError, _NEED + r".* got shape \[3\]"),
    ("v_scale", lambda a: torch.ones(8), ValueError, _NEED + r".* got shape \[8\]"),  # one per query head: no
    ("k_scale", lambda a: torch.ones(2, 2), ValueError, r"k_scale must be .* got shape \[2, 2\]"),
    ("k_scale", lambda a: torch.ones(2, device="meta"), ValueError,
     r"k_scale must be on the same device as q \(cpu\), got meta"),
    ("v_scale", lambda a: torch.ones(2).to_sparse(), TypeError, "v_scale must be a dense tensor"),
    ("k_scale", lambda a: torch.tensor([1.0, 0.0]), ValueError, r"k_scale\[1\] = 0.0 " + _VALUE),
    ("v_scale", lambda a: torch.tensor([-0.5]), ValueError, r"v_scale\[0\] = -0.5 " + _VALUE),
    ("k_scale", lambda a: torch.tensor(-0.0), ValueError, r"k_scale = -0.0 " + _VALUE),
    ("v_scale", lambda a: torch.tensor([float("nan"), 1.0]), ValueError, r"v_scale\[0\] = nan " + _VALUE),
    ("k_scale", lambda a: torch.tensor([2.0, float("inf")]), ValueError, r"k_scale\[1\] = inf " + _VALUE),
    ("v_scale", lambda a: torch.tensor(float("-inf")), ValueError, r"v_scale = -inf " + _VALUE),
]


@pytest.mark.boundary
@pytest.mark.parametrize("fn", [flashsink.attention_kvcache, reference.attention_kvcache, _op],
                         ids=["api", "reference", "op"])
@pytest.mark.parametrize("name, change, exc, match", _BAD_FP8, ids=[f"{b[0]}-{i}" for i, b in enumerate(_BAD_FP8)])
def test_fp8_refusals(fn, name, change, exc, match):
    a = _good()
    new = change(a)
    a.update(new if isinstance(new, dict) else {name: new})
    if fn is _op and isinstance(new, float):
        # a plain torch op: its schema (Tensor? k_scale) refuses a Python number before any flashsink code
        # runs, with torch's error naming the argument (issue 52: no check ahead of the schema)
        exc, match = RuntimeError, f"argument '{name}'"
    with pytest.raises(exc, match=match):
        fn(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("cache_seqlens"), **a)


@pytest.mark.boundary
@pytest.mark.parametrize("fn", [flashsink.attention_kvcache, reference.attention_kvcache, _op],
                         ids=["api", "reference", "op"])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scales_refused_with_a_bf16_cache(fn, name):
    a = _good()
    a["k_cache"], a["v_cache"] = a["k_cache"].to(BF16), a["v_cache"].to(BF16)
    a["k_scale" if name == "v_scale" else "v_scale"] = None
    with pytest.raises(ValueError, match=f"{name} is given but the cache has dtype torch.bfloat16: scales dequantize"):
        fn(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("cache_seqlens"), **a)


@pytest.mark.boundary
def test_scales_that_require_grad_are_refused():
    a = _good()
    a["v_scale"] = a["v_scale"].requires_grad_()
    with pytest.raises(NotImplementedError, match="forward only.*v_scale requires grad"):
        flashsink.attention_kvcache(**a)
    with torch.no_grad():
        flashsink.attention_kvcache(**a)


# -------------------------------------------------------------------------------------------------
# the CUDA route (GPU)

# configurations tests/gpu_cases.kvcache_cases builds too (heads, KV heads, D, dtype, sinks), so that
# tools/gpu_suite.sh's precompile covers them
_GPU_CASES = [
    Fp8Case((5000, 1, 777), 16, "tensor", heads=64, kv_heads=8, head_dim=64),
    Fp8Case((3000, 40), 256, "head", heads=64, kv_heads=8, head_dim=128, dtype=F16),
    Fp8Case((900, 33), 32, "head", window=128, heads=64, kv_heads=8, head_dim=64),
    Fp8Case((2000, 64), 64, "scalar", heads=64, kv_heads=8, head_dim=128, sinks=False),
    Fp8Case((4000, 100), None, "head", seq_q=16, window=64, heads=12, kv_heads=4, head_dim=64, dtype=F16),
    Fp8Case((200, 1000), 128, "head", seq_q=64, window=100, heads=64, kv_heads=8, head_dim=64),
    Fp8Case((700, 33), 64, "tensor", seq_q=9, heads=16, kv_heads=1, head_dim=64, dtype=F16),
]


@pytest.mark.gpu
@pytest.mark.l1
@pytest.mark.parametrize("c", _GPU_CASES, ids=str)
def test_cuda_route_against_the_fp64_formula(c):
    args, bshd = make_problem(c, device="cuda")
    o, lse = flashsink.attention_kvcache(**args, return_lse=True)
    assert o.is_cuda
    check_against_formula(c, args, bshd, o, lse)


@pytest.mark.gpu
@pytest.mark.boundary
def test_cuda_bad_scales_give_nan_in_their_heads():
    """On CUDA the scales' values are checked on the device (no host sync): a scale that is not finite and
    > 0 makes the query heads of its KV head NaN; the other heads stay right."""
    c = Fp8Case((300, 50), 16, "head", heads=64, kv_heads=8, head_dim=64)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        args, bshd = make_problem(c, device="cuda")
        args["k_scale"][3] = bad
        o, lse = flashsink.attention_kvcache(**args, return_lse=True)
        heads = torch.arange(64) // 8 == 3  # the query heads of KV head 3
        assert o[:, :, heads].isnan().all() and lse[:, heads].isnan().all()
        args["k_scale"][3] = 1.0
        bshd["k_scale"][3] = 1.0
        want, _ = fp64_formula(c, args, bshd)
        low, _ = lowp(c, args)
        assert_fast("o", o[:, :, ~heads].cpu(), want[:, :, ~heads], c.dtype, lowp=low[:, :, ~heads])


# -------------------------------------------------------------------------------------------------
# the fp8 kernel's draft (fwd_kvcache.build_fwd_kvcache(cfg, kv_fp8=True)): built and compiled here, run
# against the formula on a GPU; not routed until it is timed there (issue 53's next step)


def _draft_cfg(arch, c: Fp8Case):
    from flashsink.kernel_config import SUPPORTED_DTYPES, KernelConfig

    return KernelConfig(arch=arch, dtype=SUPPORTED_DTYPES[c.dtype], head_dim=c.head_dim, head_dim_v=c.head_dim,
                        groups=c.heads // c.kv_heads, causal=True, has_sinks=c.sinks, layout="bshd",
                        deterministic=False, precision="strict")


def _compile_draft(arch, c: Fp8Case):
    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_kvcache import build_fwd_kvcache

    return tilelang.compile(build_fwd_kvcache(_draft_cfg(arch, c), kv_fp8=True), target={"kind": "cuda", "arch": arch},
                            execution_backend="tvm_ffi", pass_configs=pass_configs())


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_fp8_kernel_draft_compiles_for_sm90a():
    """The draft reads K and V as e4m3 (16-byte loads of 16 keys' elements), widens them to bf16 in registers,
    folds the KV head's K scale into the logits' scale once and multiplies o by its V scale once; wgmma does
    the products. The default kernel keeps its signature (its TIR is unchanged: tools/tir_hashes.py)."""
    import re

    from flashsink.ops.kernels.fwd_kvcache import build_fwd_kvcache

    c = Fp8Case((1,), 16, "head", heads=64, kv_heads=8, head_dim=64)
    names = lambda f: [str(p).removesuffix("_handle") for p in f.params]  # noqa: E731
    assert names(build_fwd_kvcache(_draft_cfg("sm_90a", c), kv_fp8=True)) == [
        "Q", "K", "V", "BlockTable", "SeqLens", "KScale", "VScale", "window", "scale_log2", "OPart", "LSEPart"]
    assert "KScale" not in names(build_fwd_kvcache(_draft_cfg("sm_90a", c)))
    src = _compile_draft("sm_90a", c).get_kernel_source()
    assert "const fp8_e4_t* __restrict__ K" in src and "const fp8_e4_t* __restrict__ V" in src
    assert "wgmma" in src and "__tl_cvt_e4m3x2_to_bfloat162" in src
    assert len(re.findall(r"\*\(fp8_e4_16_t\*\)\((K|V) \+", src)) >= 2  # vector loads from the cache
    assert src.count("scale_log2 * KScale[") == 1  # K's scale: once a program, not per element


@pytest.mark.gpu
@pytest.mark.l1
@pytest.mark.parametrize("c", [_GPU_CASES[0], _GPU_CASES[4], _GPU_CASES[5]], ids=str)
def test_fp8_kernel_draft_on_the_gpu(c):
    """The draft with the merge kernel, launched as ``kvcache.kernel_attention_kvcache`` launches the default,
    against the formula under the fast gate; a bad scale makes its KV head's rows NaN."""
    from flashsink.kernel_config import LOG2E, NO_WINDOW, arch_of, split_tiles
    from flashsink.ops.compiler.registry import get_kernel
    from flashsink.ops.launch.dense import sm_count
    from flashsink.ops.launch.kvcache import n_splits_for
    from flashsink._validate_kvcache import validate_kvcache

    args, bshd = make_problem(c, device="cuda")
    spec = validate_kvcache(**{k: v for k, v in args.items() if k != "window"}, window=c.window, scale=None,
                            return_lse=True)
    cfg = _draft_cfg(arch_of(torch.device("cuda")), c)
    fwd, merge = _compile_draft(cfg.arch, c), get_kernel("merge_splits", cfg)
    B, Sq, H, Dv = spec.batch, spec.seq_q, spec.heads, spec.head_dim_v
    S = n_splits_for(spec, split_tiles(cfg), sm_count(torch.device("cuda")))
    table = args["block_table"]
    if table is None:
        table = torch.arange(B, dtype=torch.int32, device="cuda").view(B, 1)
    sinks = args["sinks"] if args["sinks"] is not None else torch.zeros(H, device="cuda")
    window = NO_WINDOW if c.window is None else c.window

    def run(k_scale, v_scale):
        o_part = torch.empty(B, H, Sq, S, Dv, device="cuda")
        lse_part = torch.empty(B, H, Sq, S, device="cuda")
        o = torch.empty(B, Sq, H, Dv, dtype=c.dtype, device="cuda")
        lse = torch.empty(B, H, Sq, device="cuda")
        per_head = lambda s: s.reshape(-1).expand(spec.kv_heads).contiguous()  # noqa: E731
        fwd(args["q"], args["k_cache"], args["v_cache"], table, args["cache_seqlens"], per_head(k_scale),
            per_head(v_scale), window, spec.scale * LOG2E, o_part, lse_part)
        merge(o_part, lse_part, sinks, o, lse)
        return o, lse

    o, lse = run(args["k_scale"], args["v_scale"])
    check_against_formula(c, args, bshd, o, lse)
    bad = args["v_scale"].reshape(-1).expand(spec.kv_heads).clone()
    bad[spec.kv_heads - 1] = 0.0
    o, lse = run(args["k_scale"], bad)
    last = torch.arange(H, device="cuda") // spec.groups == spec.kv_heads - 1
    assert o[:, :, last].isnan().all() and lse[:, last].isnan().all() and not o[:, :, ~last].isnan().any()
