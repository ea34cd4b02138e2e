"""``torch.compile(fullgraph=True, dynamic=True)`` through flashsink, and the custom ops behind the kernels.

* CPU (CI): ``flashsink.attention`` off CUDA is the reference, traced as plain torch ops: a small model
  and ``flashsink.nn.SinkAttention`` compiled with ``fullgraph=True, dynamic=True``, run at two sequence
  lengths with recompilation an error, forward and backward (through the returned lse too).
* The CUDA path's structure on the CPU: ``kernel_attention`` (head-dim padding, the ``flashsink::fwd``
  op, its autograd formula calling ``flashsink::bwd``, the slicing of o and the row-padded lse) runs on
  CPU tensors too, where the ops' implementations are the reference and its closed-form gradient. So the
  wiring the kernels sit behind is proven here, eagerly and compiled, and ``torch.library.opcheck``
  checks the ops' schemas, fake implementations, autograd registration and AOT dispatch.
* Varlen: ``flashsink.attention_varlen`` compiled the same way over several length sets (new lengths, a
  new number of sequences, empty sequences), with its ``cu_seqlens`` checks as asserts in the graph;
  the ops ``flashsink::varlen_fwd`` / ``varlen_bwd`` (opcheck, fake shapes) and their head-dim padding
  on the CPU.
* KV cache: ``flashsink.attention_kvcache`` compiled the same way (new batch, lengths, page size and page
  count, paged and contiguous caches), the op ``flashsink::kvcache_fwd`` (opcheck, its fake on meta tensors),
  its value and grad checks under compile.
* GPU (``gpu`` marker): the same compiled functions on the kernels, against the eager kernels and the
  float64 reference, with ``precision="strict"`` pinned (the standard) and, for configurations the kernel
  matrix already builds in that mode, with ``precision="fast"`` (the fast gate).

Every comparison is the precision standard (the fast gate for the fast cases): expected = float64 (the
eager reference, or the eager model/module in float64), ``lowp`` = the eager computation in the input
dtype where one exists.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import flashsink
from flashsink import testing
from flashsink._validate import validate_attention, validate_varlen
from flashsink.nn import SinkAttention
from flashsink.ops.launch.attention import kernel_attention, kernel_attention_varlen
from flashsink.ops.launch.dense import varlen_rows

pytestmark = pytest.mark.l1

LENGTHS = (37, 70)  # two lengths, neither a multiple of any tile; one compiled graph must serve both
GPU_LENGTHS = (300, 517)


@pytest.fixture
def counter():
    """A fresh dynamo state, recompilation as an error, and a backend that keeps the captured graphs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield CompileCounterWithBackend("inductor")
    torch._dynamo.reset()


def _ops_in(counter) -> set:
    return {str(node.target) for g in counter.graphs for node in g.graph.nodes if node.op == "call_function"}


def _flashsink_ops(counter) -> set:
    return {t for t in _ops_in(counter) if "flashsink" in t}


def _assert_all(reports):
    failed = [r for r in reports if not r.passed]
    assert not failed, "precision gate failed\n" + "\n".join([testing.PrecisionReport.header()] + [r.row() for r in reports])


def _judge(label, names, got, expected, lowp, dtype, precision="strict"):
    """``got`` against the float64 ``expected`` under the gate of ``precision``: "strict" the standard (gate 2
    with ``lowp``, the reference in the input dtype), "fast" the fast gate (``lowp`` required)."""
    if precision == "fast":
        return [testing.check_fast(f"{label} {nm}", a, e, dtype, lowp=lo) for nm, a, e, lo in zip(names, got, expected, lowp)]
    return [testing.check_precision(f"{label} {nm}", a, e, dtype, lowp=lo) for nm, a, e, lo in zip(names, got, expected, lowp)]


def _grads(fn, leaves, *args):
    """Run ``fn(*leaves, *args) -> (outputs, cotangents)`` and return the outputs and the leaves' gradients."""
    outs, cots = fn(*leaves, *args)
    grads = torch.autograd.grad(outs, leaves, cots)
    return [o.detach() for o in outs], list(grads)


# ------------------------------------------------------------------------------------------------
# CPU: the reference path, compiled


class TinyAttnModel(nn.Module):
    """Projections around flashsink.attention ("bshd", GQA, window, sinks), returning the output and lse."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, window=8):
        super().__init__()
        self.h, self.hk, self.d, self.window = heads, kv_heads, head_dim, window
        self.q = nn.Linear(hidden, heads * head_dim)
        self.kv = nn.Linear(hidden, 2 * kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, hidden)
        self.sinks = nn.Parameter(torch.linspace(-1.5, 1.5, heads))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d)
        k, v = self.kv(x).view(b, s, 2, self.hk, self.d).unbind(2)
        o, lse = flashsink.attention(q, k, v, self.sinks, window=self.window, layout="bshd", return_lse=True)
        return self.o(o.reshape(b, s, self.h * self.d)), lse


def _model_step(model, x, g_out, g_lse):
    """Outputs and the gradients of every parameter and of x, for the loss <out, g_out> + <lse, g_lse>."""
    x = x.clone().requires_grad_(True)
    params = [p for _, p in model.named_parameters()]
    out, lse = model(x)
    grads = torch.autograd.grad([out, lse], [x] + params, [g_out.to(out.dtype), g_lse.to(lse.dtype)])
    names = ["x"] + [n.removeprefix("_orig_mod.") for n, _ in model.named_parameters()]
    return {"out": out.detach(), "lse": lse.detach(), **dict(zip(names, grads))}


def test_model_fullgraph_dynamic_cpu(counter):
    torch.manual_seed(0)
    model = TinyAttnModel()
    expected_model = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for n in LENGTHS:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(2, n, 64, generator=g)
        g_out, g_lse = torch.randn(2, n, 64, generator=g), torch.randn(2, 4, n, generator=g)
        actual = _model_step(compiled, x, g_out, g_lse)
        lowp = _model_step(model, x, g_out, g_lse)
        expected = _model_step(expected_model, x.double(), g_out.double(), g_lse.double())
        _assert_all([testing.check_precision(f"{name}@{n}", actual[name], expected[name], torch.float32, lowp=lowp[name])
                     for name in expected])
    assert counter.frame_count == 1  # one graph for both lengths (a recompile would have raised)
    assert not _flashsink_ops(counter)  # off CUDA: the reference, as plain torch ops


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sink_attention_module_fullgraph_dynamic_cpu(counter, layout):
    torch.manual_seed(1)
    module = SinkAttention(num_heads=8, num_kv_heads=2, head_dim=32, window=16, layout=layout)
    with torch.no_grad():
        module.sinks.normal_(0.0, 1.0)  # sinks that matter (the default init is N(0, 0.02^2))
    expected_module = copy.deepcopy(module).double()
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)

    def step(mod, q, k, v, do, dlse):
        return (*mod(q, k, v, return_lse=True),), (do, dlse)

    for n in LENGTHS:
        inp = testing.make_inputs(2, 8, 2, n, n, 32, torch.float32, "cpu", layout=layout, seed=n)
        dlse = torch.randn(2, 8, n, generator=torch.Generator().manual_seed(n))
        leaves = [inp[x].clone().requires_grad_(True) for x in ("q", "k", "v")]
        lv64 = [inp[x].double().requires_grad_(True) for x in ("q", "k", "v")]

        def run(mod, ls, do, dl):
            (o, lse), _ = step(mod, *ls, do, dl)
            grads = torch.autograd.grad([o, lse], ls + [mod.sinks], [do, dl])
            return [o.detach(), lse.detach(), *grads]

        actual = run(compiled, leaves, inp["do"], dlse)
        lowp = run(module, leaves, inp["do"], dlse)
        expected = run(expected_module, lv64, inp["do"].double(), dlse.double())
        names = ("o", "lse", "dq", "dk", "dv", "dsink")
        _assert_all([testing.check_precision(f"{nm}@{n}", a, e, torch.float32, lowp=lo)
                     for nm, a, e, lo in zip(names, actual, expected, lowp)])
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------------------
# The kernel path's wiring (custom ops, autograd, padding, slicing), on the CPU


def kernel_path(q, k, v, sinks, window=None, causal=True, layout="bhsd", deterministic=False):
    """What flashsink.attention runs for CUDA tensors, callable on any device."""
    spec = validate_attention(q, k, v, sinks, window=window, causal=causal, scale=None, layout=layout)
    return kernel_attention(spec, q, k, v, sinks, return_lse=True, deterministic=deterministic)


# b, h, hk, sq, skv, d, window, causal, layout, sinks
OP_CASES = [
    (2, 8, 2, 37, 37, 64, 9, True, "bhsd", True),
    (1, 6, 2, 29, 40, 48, None, True, "bshd", True),  # head dim padded 48 -> 64, seq_q < seq_kv
    (2, 4, 4, 33, 20, 32, 5, True, "bhsd", False),  # rows that see no key and no sink (lse = -inf)
    (1, 4, 1, 21, 21, 16, None, False, "bshd", True),  # MQA, non-causal, D 16 -> 32
]


def _op_case_id(c):
    b, h, hk, sq, skv, d, w, causal, layout, sinks = c
    return testing.case_id(batch=b, heads=h, kv_heads=hk, seq_q=sq, seq_kv=skv, head_dim=d, window=w,
                           causal=causal, layout=layout, sinks=sinks, dtype=torch.bfloat16)


def _expected_and_lowp(inp, dlse, window, causal, layout, leaves_of):
    """The reference's o, lse and gradients (loss <o, do> + <lse, dlse>) in float64 and in the input dtype."""
    out = []
    for cast in (lambda x: x.double(), lambda x: x):
        ls = leaves_of(inp, cast)
        o, lse = flashsink.reference.attention(*ls, window=window, causal=causal, layout=layout, return_lse=True,
                                               compute_dtype=torch.float64 if cast(inp["q"]).dtype == torch.float64
                                               else inp["q"].dtype)
        grads = torch.autograd.grad([o, lse], ls, [cast(inp["do"]), cast(dlse).to(lse.dtype)])
        out.append([o.detach(), lse.detach(), *grads])
    return out


def _leaves(inp, cast):
    names = ("q", "k", "v") + (("sinks",) if inp["sinks"] is not None else ())
    return [cast(inp[n]).detach().clone().requires_grad_(True) for n in names]


@pytest.mark.parametrize("case", OP_CASES, ids=_op_case_id)
def test_kernel_path_on_cpu_eager_and_compiled(counter, case):
    """The custom-op path (eager, then compiled with fullgraph + dynamic at two lengths) against the
    float64 reference, every output and gradient, with a gradient through lse; and compiled == eager."""
    b, h, hk, sq, skv, d, window, causal, layout, sinks = case
    if case is not OP_CASES[0]:  # inductor for one case; AOT autograd alone (what the ops meet) for the others
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(kernel_path, backend=counter, fullgraph=True, dynamic=True)
    for extra in (0, 23):  # a second length for the compiled graph
        inp = testing.make_inputs(b, h, hk, sq + extra, skv + extra, d, torch.bfloat16, "cpu", layout=layout,
                                  sinks=sinks, seed=sq + extra)
        dlse = torch.randn(b, h, sq + extra, generator=torch.Generator().manual_seed(extra))
        names = ["o", "lse", "dq", "dk", "dv"] + (["dsink"] if sinks else [])
        expected, lowp = _expected_and_lowp(inp, dlse, window, causal, layout, _leaves)

        def run(fn):
            ls = _leaves(inp, lambda x: x)
            s = ls[3] if sinks else None
            o, lse = fn(*ls[:3], s, window, causal, layout)
            grads = torch.autograd.grad([o, lse], ls, [inp["do"], dlse])
            return [o.detach(), lse.detach(), *grads]

        eager, comp = run(kernel_path), run(compiled)
        for got in (eager, comp):
            _assert_all([testing.check_precision(nm, a, e, torch.bfloat16, lowp=lo)
                         for nm, a, e, lo in zip(names, got, expected, lowp)])
            assert [t.dtype for t in got] == [t.dtype for t in lowp]
        _assert_all([testing.check_precision(f"compiled-vs-eager {nm}", c, e, torch.bfloat16)
                     for nm, c, e in zip(names, comp, eager)])
    assert counter.frame_count == 1
    assert {"flashsink.fwd.default"} <= _flashsink_ops(counter) or {"flashsink.fwd"} <= _flashsink_ops(counter)


def test_kernel_path_without_lse_gradient_and_sinks_dtype():
    """Only o in the loss (the lse cotangent is materialised as zeros); sinks in bfloat16 get a bfloat16
    gradient; deterministic is accepted."""
    inp = testing.make_inputs(1, 4, 2, 30, 30, 32, torch.float16, "cpu", seed=3)
    ls = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v")]
    s = inp["sinks"].to(torch.bfloat16).requires_grad_(True)
    o, _ = kernel_path(*ls, s, window=7, deterministic=True)
    grads = torch.autograd.grad(o, ls + [s], inp["do"])
    assert grads[3].dtype == torch.bfloat16
    ls64 = [inp[n].double().requires_grad_(True) for n in ("q", "k", "v")] + [s.detach().double().requires_grad_(True)]
    o64 = flashsink.reference.attention(*ls64, window=7)
    exp = torch.autograd.grad(o64, ls64, inp["do"].double())
    _assert_all([testing.check_precision("o", o, o64, torch.float16)]
                + [testing.check_precision(nm, a, e, torch.float16) for nm, a, e in zip(("dq", "dk", "dv"), grads, exp)]
                + [testing.check_precision("dsink", grads[3], exp[3], torch.bfloat16)])


# ------------------------------------------------------------------------------------------------
# The ops themselves


def _op_args(device, dtype, layout, sinks, window, causal, d=32, seq_q=37, seq_kv=37, precision="fast"):
    inp = testing.make_inputs(2, 4, 2, seq_q, seq_kv, d, dtype, device, layout=layout, sinks=sinks, seed=7)
    q, k, v = (inp[n].requires_grad_(True) for n in ("q", "k", "v"))
    s = None if inp["sinks"] is None else inp["sinks"].requires_grad_(True)
    return inp, (q, k, v, s, window, causal, d ** -0.5, layout, False, precision)


OPCHECK_CASES = [("bhsd", True, 9, True, "fast"), ("bshd", False, None, True, "strict"), ("bshd", True, None, False, "fast")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=testing.dtype_name)
@pytest.mark.parametrize("layout, sinks, window, causal, precision", OPCHECK_CASES)
def test_opcheck_cpu(dtype, layout, sinks, window, causal, precision):
    inp, args = _op_args("cpu", dtype, layout, sinks, window, causal, precision=precision)
    torch.library.opcheck(torch.ops.flashsink.fwd.default, args)
    o, lse = (t.detach() for t in torch.ops.flashsink.fwd(*args))
    assert lse.shape == (2, 4, 128) and (lse[:, :, 37:] == 0).all()  # row-padded, padding rows zero
    detached = [None if t is None else t.detach() for t in args[:4]]
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.flashsink.bwd.default, (inp["do"], *detached, lse, dlse, *args[4:], o))
    torch.library.opcheck(torch.ops.flashsink.bwd.default, (inp["do"], *detached, lse, None, *args[4:], None))


def test_fake_shapes():
    """The fake implementations: o in the layout, lse with padded_rows(seq_q) rows, dsink in the sinks' dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for sq, rows in ((1, 128), (128, 128), (129, 256), (1000, 1024)):
            q = torch.empty(2, sq, 8, 64, dtype=torch.bfloat16)
            k = torch.empty(2, 50, 2, 64, dtype=torch.bfloat16)
            v = torch.empty(2, 50, 2, 32, dtype=torch.bfloat16)
            sinks = torch.empty(8, dtype=torch.float16)
            o, lse = torch.ops.flashsink.fwd(q, k, v, sinks, None, True, 0.125, "bshd", False)
            assert o.shape == (2, sq, 8, 32) and o.dtype == torch.bfloat16 and o.is_contiguous()
            assert lse.shape == (2, 8, rows) and lse.dtype == torch.float32
            dq, dk, dv, ds = torch.ops.flashsink.bwd(o, q, k, v, sinks, lse, lse, None, True, 0.125, "bshd", False)
            assert (dq.shape, dk.shape, dv.shape, ds.shape) == (q.shape, k.shape, v.shape, (8,))
            assert ds.dtype == torch.float16
            ds = torch.ops.flashsink.bwd(o, q, k, v, None, lse, None, None, True, 0.125, "bshd", False)[3]
            assert ds.dtype == torch.float32


def test_import_registers_ops_without_tilelang():
    code = ("import sys, torch, flashsink; "
            "print(*[hasattr(torch.ops.flashsink, op) for op in ('fwd', 'bwd', 'varlen_fwd', 'varlen_bwd', "
            "'kvcache_fwd')], 'tilelang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True"] * 5 + ["False"]


# ------------------------------------------------------------------------------------------------
# GPU: the kernels, compiled


GPU_CASES = [
    # h, hk, d, window, layout, sinks, deterministic, precision
    (8, 2, 64, 100, "bhsd", True, False, "strict"),
    (16, 2, 128, None, "bshd", True, False, "strict"),
    (8, 8, 80, 64, "bhsd", False, False, "strict"),  # head dim padded 80 -> 128, no sinks
    (12, 4, 64, 33, "bshd", True, True, "strict"),
    # fast: configurations tests/gpu_cases.py already builds in that mode ("d80", "bshd"), so no new
    # kernels; the first pads 80 -> 128, so the o the fast backward reads is the op's padded one
    (8, 2, 80, 64, "bhsd", True, False, "fast"),
    (12, 4, 64, 33, "bshd", True, False, "fast"),
]


def _forward_routes(q, k, window, layout, deterministic, precision) -> tuple:
    """``(eager fwd_o32, traced fwd_window)`` for the problem of ``q`` and ``k``: whether flashsink.attention's
    eager route with gradients runs ``fwd_o32`` (``config.fwd_o32``: 128-key tiles, two-term P @ V), and
    whether the traced route's op (no fp32 O) runs ``fwd_window`` (``kinds.forward_kind``: 64-key tiles,
    so each row's sums split differently and lse is within one rounding of ``fwd_o32``'s, not bitwise)."""
    from flashsink import kernel_config as config
    from flashsink.ops.compiler.kinds import forward_kind
    from flashsink.ops.launch import dense

    spec = validate_attention(q, k, k, None, window=window, causal=True, scale=None, layout=layout)
    cfg = dense.kernel_config(spec, q.device, deterministic, precision)
    return (config.fwd_o32(cfg),
            forward_kind(cfg, dense.kernel_window(window), float(spec.scale)) == "fwd_window")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "H{}-HK{}-D{}-W{}-{}-{}{}-{}".format(
    c[0], c[1], c[2], c[3], c[4], "sink" if c[5] else "nosink", "-det" if c[6] else "", c[7]))
def test_kernels_fullgraph_dynamic_gpu(counter, case):
    """flashsink.attention on CUDA bf16 compiled (fullgraph, dynamic, inductor) at two lengths: every output
    and gradient (lse in the loss) under the gate of the case's precision (the standard for "strict", the
    fast gate for "fast") against the float64 reference, and against the eager kernels (the standard; lse
    bitwise, and o bitwise where both routes run the same forward kernel: strict's eager forward with
    gradients on Hopper is ``fwd_o32``, two-term P @ V, whose o is within one rounding of the traced
    route's, ``config.fwd_o32``; under a window of at most 128 keys the traced route's forward is
    ``fwd_window``, over 64-key tiles, so its lse too is within one rounding of ``fwd_o32``'s)."""
    h, hk, d, window, layout, sinks, det, precision = case

    def fn(q, k, v, s):
        return flashsink.attention(q, k, v, s, window=window, layout=layout, return_lse=True, deterministic=det,
                                   precision=precision)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for i, n in enumerate(GPU_LENGTHS):
        # batch 3 + 2i: a batch equal to another size (H_kv = 2, say) is duck-sized into a guard that
        # the next call breaks (a recompile, not a flashsink one)
        inp = testing.make_inputs(3 + 2 * i, h, hk, n, n, d, torch.bfloat16, "cuda", layout=layout, sinks=sinks, seed=n)
        dlse = torch.randn(3 + 2 * i, h, n, generator=torch.Generator().manual_seed(n)).cuda()
        names = ["o", "lse", "dq", "dk", "dv"] + (["dsink"] if sinks else [])
        expected, lowp = _expected_and_lowp(inp, dlse, window, True, layout, _leaves)

        def run(f):
            ls = _leaves(inp, lambda x: x)
            o, lse = f(*ls[:3], ls[3] if sinks else None)
            return [o.detach(), lse.detach(), *torch.autograd.grad([o, lse], ls, [inp["do"], dlse])]

        eager, comp = run(fn), run(compiled)
        for label, got in (("eager", eager), ("compiled", comp)):
            _assert_all(_judge(f"{label}@{n}", names, got, expected, lowp, torch.bfloat16, precision))
        _assert_all([testing.check_precision(f"compiled-vs-eager {nm}@{n}", c, e, torch.bfloat16)
                     for nm, c, e in zip(names, comp, eager)])
        o32, windowed = _forward_routes(inp["q"], inp["k"], window, layout, det, precision)
        # lse bitwise where both routes sum each row over the same key tiles (eager fwd_o32 against a traced
        # fwd_window does not: 128-key against 64-key tiles; both are judged above)
        assert torch.equal(comp[1], eager[1]) or (o32 and windowed)
        assert torch.equal(comp[0], eager[0]) or o32
    assert counter.frame_count == 1
    ops = _flashsink_ops(counter)
    assert any("flashsink.fwd" in t for t in ops), f"the kernels' op is not in the graph: {sorted(_ops_in(counter))}"


@pytest.mark.gpu
@pytest.mark.parametrize("seq_q, seq_kv", [(150, 150), (3, 3000)], ids=["prefill", "decode"])
@pytest.mark.parametrize("layout, sinks, window, causal, precision", OPCHECK_CASES)
def test_opcheck_gpu(layout, sinks, window, causal, precision, seq_q, seq_kv):
    """Fake vs real (shapes, strides, dtypes), schema, autograd registration, AOT dispatch; the decode
    shape (few rows, long cache) reaches the forward's key-split path where it applies."""
    inp, args = _op_args("cuda", torch.bfloat16, layout, sinks, window, causal, d=64, seq_q=seq_q, seq_kv=seq_kv,
                         precision=precision)
    args = args[:-2] + (True, precision)  # deterministic: the backward is bitwise reproducible, as opcheck compares runs
    torch.library.opcheck(torch.ops.flashsink.fwd.default, args)
    o, lse = (t.detach() for t in torch.ops.flashsink.fwd(*args))
    rows = 256 if seq_q > 128 else 128
    assert lse.shape == (2, 4, rows) and (lse[:, :, seq_q:] == 0).all()
    detached = [None if t is None else t.detach() for t in args[:4]]
    dlse = torch.randn(lse.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.library.opcheck(torch.ops.flashsink.bwd.default, (inp["do"], *detached, lse, dlse, *args[4:], o))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", testing.PRECISIONS)
def test_sink_attention_module_fullgraph_gpu(counter, precision):
    """SinkAttention (G4, D64, bf16, bshd: a configuration the kernel matrix builds in both modes) compiled,
    its precision passed to the kernels: o and the gradients under that mode's gate."""
    module = SinkAttention(num_heads=16, num_kv_heads=4, head_dim=64, window=128, layout="bshd",
                           precision=precision).cuda()
    with torch.no_grad():
        module.sinks.normal_(0.0, 1.0)
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    for n in GPU_LENGTHS:
        inp = testing.make_inputs(2, 16, 4, n, n, 64, torch.bfloat16, "cuda", layout="bshd", seed=n)
        ls = [inp[x].clone().requires_grad_(True) for x in ("q", "k", "v")]
        o = compiled(*ls)
        grads = torch.autograd.grad(o, ls + [module.sinks], inp["do"])
        expected, lowp = (testing.reference_grads(inp["q"], inp["k"], inp["v"], module.sinks.detach(), inp["do"],
                                                  window=128, layout="bshd", compute_dtype=cdt)
                          for cdt in (torch.float64, torch.bfloat16))
        names = ("o", "dq", "dk", "dv", "dsink")
        _assert_all(_judge(f"@{n}", names, [o, *grads], [expected[nm] for nm in names], [lowp[nm] for nm in names],
                           torch.bfloat16, precision))
    assert counter.frame_count == 1
    assert any("flashsink.fwd" in t for t in _flashsink_ops(counter))


# ------------------------------------------------------------------------------------------------
# Varlen: flashsink.attention_varlen compiled, and the ops flashsink::varlen_fwd / varlen_bwd

# (lens_q, lens_k) per call of one compiled graph: new lengths, a new number of sequences, a sequence
# with no queries, one with no keys, more keys than queries (bottom-right per sequence). No size equals
# another in one call and not in the next (dynamo's duck sizing would guard on that and recompile).
VARLEN_LENS = [
    ((5, 0, 17, 9), (5, 3, 20, 30)),
    ((1, 12, 40, 2, 7), (9, 12, 41, 0, 7)),
    ((23, 3, 11), (23, 30, 11)),
]
GPU_VARLEN_LENS = [
    ((300, 0, 517, 1, 64), (300, 5, 600, 1, 64)),
    ((129, 1000, 3), (140, 1000, 700)),
    ((77, 256, 255, 18, 400, 2), (77, 300, 255, 19, 400, 2)),
]
VARLEN_NAMES = ("o", "lse", "dq", "dk", "dv", "dsink")


def _cu(lens, device):
    return torch.tensor((0,) + tuple(lens), dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _varlen_inputs(lens_q, lens_k, h, hk, d, dtype, device, *, sinks=True, seed=0):
    """Fresh random packed inputs ([total, heads, dim]); do and dlse ([H, total_q]) for the loss."""
    tq, tk = sum(lens_q), sum(lens_k)
    inp = testing.make_inputs(1, h, hk, tq, tk, d, dtype, device, layout="bshd", sinks=sinks, seed=seed)
    inp = {n: (t[0] if n in ("q", "k", "v", "do") else t) for n, t in inp.items()}
    inp["dlse"] = torch.randn(h, tq, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    inp.update(cu_q=_cu(lens_q, device), cu_k=_cu(lens_k, device), max_q=max(lens_q), max_k=max(lens_k))
    return inp


def _varlen_run(fn, inp, cast=lambda x: x):
    """o, lse and the gradients of q, k, v (and sinks) for the loss <o, do> + <lse, dlse>."""
    leaves = [cast(inp[n]).detach().clone().requires_grad_(True)
              for n in ("q", "k", "v", "sinks") if inp[n] is not None]
    o, lse = fn(*leaves[:3], inp["cu_q"], inp["cu_k"], inp["max_q"], inp["max_k"], leaves[3] if len(leaves) > 3 else None)
    grads = torch.autograd.grad([o, lse], leaves, [cast(inp["do"]).to(o.dtype), cast(inp["dlse"]).to(lse.dtype)])
    return [o.detach(), lse.detach(), *grads]


def _varlen_reference(window, causal, compute_dtype):
    def fn(q, k, v, cu_q, cu_k, max_q, max_k, s):
        return flashsink.reference.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, s, window=window, causal=causal,
                                                    return_lse=True, compute_dtype=compute_dtype)
    return fn


def _check_varlen(label, actual, inp, dtype, window, causal, eager=None, precision="strict"):
    """actual against the float64 reference (lowp: the reference in the input dtype) under the gate of
    ``precision`` and, if given, against the eager run of the same function (the standard)."""
    names = VARLEN_NAMES[: len(actual)]
    expected = _varlen_run(_varlen_reference(window, causal, torch.float64), inp, lambda x: x.double())
    lowp = _varlen_run(_varlen_reference(window, causal, dtype), inp)
    reports = _judge(label, names, actual, expected, lowp, dtype, precision)
    if eager is not None:
        reports += [testing.check_precision(f"{label} compiled-vs-eager {nm}", a, e, dtype)
                    for nm, a, e in zip(names, actual, eager)]
    _assert_all(reports)


@pytest.mark.parametrize("window, causal, sinks", [(5, True, True), (None, False, False)], ids=["W5-sink", "noncausal-nosink"])
def test_varlen_fullgraph_dynamic_cpu(counter, window, causal, sinks):
    """flashsink.attention_varlen compiled (fullgraph, dynamic, inductor): one graph for every length set,
    outputs and gradients (lse in the loss) against the float64 reference and the eager call."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, s):
        return flashsink.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, s, window=window, causal=causal,
                                          return_lse=True)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for i, (lens_q, lens_k) in enumerate(VARLEN_LENS):
        inp = _varlen_inputs(lens_q, lens_k, 8, 2, 16, torch.bfloat16, "cpu", sinks=sinks, seed=100 + i)
        comp, eager = _varlen_run(compiled, inp), _varlen_run(fn, inp)
        _check_varlen(f"@{lens_q}", comp, inp, torch.bfloat16, window, causal, eager=eager)
        assert [t.dtype for t in comp] == [t.dtype for t in eager]
    assert counter.frame_count == 1  # one graph for every length set (a recompile would have raised)
    assert any("flashsink.varlen_fwd" in t for t in _flashsink_ops(counter)), sorted(_ops_in(counter))


def varlen_kernel_path(q, k, v, cu_q, cu_k, max_q, max_k, s, window=None, causal=True):
    """What flashsink.attention_varlen runs for CUDA tensors (head dims padded around the op), on any device."""
    spec = validate_varlen(q, k, v, cu_q, cu_k, max_q, max_k, s, window=window, causal=causal, scale=None)
    return kernel_attention_varlen(spec, q, k, v, cu_q, cu_k, s, return_lse=True, pad_head_dims=True)


def test_varlen_kernel_path_on_cpu_eager_and_compiled(counter):
    """The CUDA path's wiring on CPU tensors: head dim 48 padded to 64 around flashsink::varlen_fwd, o sliced
    back, lse sliced to the tokens, autograd through flashsink::varlen_bwd; eager and compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(varlen_kernel_path, backend=counter, fullgraph=True, dynamic=True)
    for i, (lens_q, lens_k) in enumerate(VARLEN_LENS):
        inp = _varlen_inputs(lens_q, lens_k, 6, 2, 48, torch.float16, "cpu", seed=200 + i)
        for label, f in (("eager", varlen_kernel_path), ("compiled", compiled)):
            _check_varlen(f"{label}@{lens_q}", _varlen_run(lambda *a: f(*a, window=9), inp), inp, torch.float16, 9, True)
    assert counter.frame_count == 1
    assert any("flashsink.varlen_fwd" in t for t in _flashsink_ops(counter))


def test_varlen_traced_validation_cpu(counter):
    """Under tracing the value checks of cu_seqlens / max_seqlen run inside the ops (the CPU op: on the host):
    a bad call of the compiled function (same shapes, no recompile) raises the eager ValueError."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, cu_q, cu_k, max_q, max_k):
        return flashsink.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    inp = _varlen_inputs((3, 5), (4, 9), 4, 2, 8, torch.float32, "cpu", seed=5)
    args = dict(q=inp["q"], k=inp["k"], v=inp["v"], cu_q=inp["cu_q"], cu_k=inp["cu_k"], max_q=5, max_k=9)
    torch.testing.assert_close(compiled(**args), fn(**args))
    i32 = torch.int32
    bad = [
        (dict(cu_q=torch.tensor([1, 3, 8], dtype=i32)), r"cu_seqlens_q must start at 0"),
        (dict(cu_k=torch.tensor([0, 4, 12], dtype=i32)), r"cu_seqlens_k\[-1\] must equal the total number of tokens"),
        (dict(cu_k=torch.tensor([0, 9, 4], dtype=i32)), r"cu_seqlens_k must be non-decreasing"),
        (dict(cu_q=torch.tensor([0, 3, 7], dtype=i32)), r"cu_seqlens_q\[-1\] must equal the total number of tokens"),
        (dict(max_q=4), r"max_seqlen_q must be >= the longest sequence \(5\)"),
        (dict(max_k=8), r"max_seqlen_k must be >= the longest sequence \(9\)"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            compiled(**{**args, **change})
        with pytest.raises(ValueError, match=message):  # eagerly: the same error (tests/test_validation.py)
            fn(**{**args, **change})
    assert counter.frame_count == 1


VARLEN_OPCHECK_CASES = [(True, 9, True, "fast"), (False, None, True, "strict"), (True, None, False, "fast")]  # sinks, window, causal, precision


def _varlen_op_args(device, dtype, sinks, window, causal, lens_q, lens_k, d=32, deterministic=False, precision="fast"):
    inp = _varlen_inputs(lens_q, lens_k, 4, 2, d, dtype, device, sinks=sinks, seed=7)
    q, k, v = (inp[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = None if inp["sinks"] is None else inp["sinks"].clone().requires_grad_(True)
    return inp, (q, k, v, s, inp["cu_q"], inp["cu_k"], inp["max_q"], inp["max_k"], window, causal, d ** -0.5,
                 deterministic, precision)


def _opcheck_varlen(inp, args, rows):
    torch.library.opcheck(torch.ops.flashsink.varlen_fwd.default, args)
    o, lse = (t.detach() for t in torch.ops.flashsink.varlen_fwd(*args))
    total = args[0].shape[0]
    assert lse.shape == (4, rows) and (lse[:, total:] == 0).all()  # row-padded, padding rows zero
    detached = [None if t is None else t.detach() for t in args[:4]]
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)).to(lse.device)
    for dl in (dlse, None):
        torch.library.opcheck(torch.ops.flashsink.varlen_bwd.default, (inp["do"], *detached, lse, dl, *args[4:], o))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=testing.dtype_name)
@pytest.mark.parametrize("sinks, window, causal, precision", VARLEN_OPCHECK_CASES)
def test_opcheck_varlen_cpu(dtype, sinks, window, causal, precision):
    lens_q, lens_k = (5, 0, 17, 9), (5, 3, 20, 30)
    inp, args = _varlen_op_args("cpu", dtype, sinks, window, causal, lens_q, lens_k, precision=precision)
    _opcheck_varlen(inp, args, rows=varlen_rows(sum(lens_q)))


def test_varlen_fake_shapes():
    """o [total_q, H, D_v] contiguous in q's dtype, lse [H, dense.varlen_rows(total_q)], dsink in the sinks' dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for tq, rows in ((0, 128), (1, 256), (128, 256), (129, 384), (1000, 1152)):
            q = torch.empty(tq, 8, 64, dtype=torch.bfloat16)
            k = torch.empty(50, 2, 64, dtype=torch.bfloat16)
            v = torch.empty(50, 2, 32, dtype=torch.bfloat16)
            cu = torch.empty(4, dtype=torch.int32)
            sinks = torch.empty(8, dtype=torch.float16)
            o, lse = torch.ops.flashsink.varlen_fwd(q, k, v, sinks, cu, cu, 400, 50, None, True, 0.125, False)
            assert o.shape == (tq, 8, 32) and o.dtype == torch.bfloat16 and o.is_contiguous()
            assert lse.shape == (8, rows) and lse.dtype == torch.float32
            dq, dk, dv, ds = torch.ops.flashsink.varlen_bwd(o, q, k, v, sinks, lse, lse, cu, cu, 400, 50, None, True,
                                                            0.125, False)
            assert (dq.shape, dk.shape, dv.shape, ds.shape, ds.dtype) == (q.shape, k.shape, v.shape, (8,), torch.float16)
            ds = torch.ops.flashsink.varlen_bwd(o, q, k, v, None, lse, None, cu, cu, 400, 50, 7, True, 0.125, True)[3]
            assert ds.dtype == torch.float32


# h, hk, d, window, sinks, deterministic, precision
GPU_VARLEN_CASES = [
    (8, 2, 64, 100, True, False, "strict"),
    (16, 2, 128, None, True, False, "strict"),
    (8, 8, 80, 64, False, False, "strict"),  # head dim padded 80 -> 128, no sinks
    (12, 4, 64, 33, True, True, "strict"),
    # fast: varlen configurations tests/gpu_cases.py already builds in that mode ("gqa4-causal", "d96": head
    # dim padded 96 -> 128, so the o the fast backward reads is the op's padded one)
    (8, 2, 64, 100, True, False, "fast"),
    (4, 2, 96, 64, True, False, "fast"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_VARLEN_CASES, ids=lambda c: "H{}-HK{}-D{}-W{}-{}{}-{}".format(
    c[0], c[1], c[2], c[3], "sink" if c[4] else "nosink", "-det" if c[5] else "", c[6]))
def test_varlen_kernels_fullgraph_dynamic_gpu(counter, case):
    """flashsink.attention_varlen on CUDA bf16 compiled (fullgraph, dynamic, inductor) over several length sets:
    every output and gradient (lse in the loss) under the gate of the case's precision against the float64
    reference, and against the eager kernels (the standard; o and lse bitwise: the same forward kernel on the
    same inputs). Outputs are poisoned (conftest's NaN torch.empty), inputs fresh per length set."""
    h, hk, d, window, sinks, det, precision = case

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, s):
        return flashsink.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, s, window=window, return_lse=True,
                                          deterministic=det, precision=precision)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for i, (lens_q, lens_k) in enumerate(GPU_VARLEN_LENS):
        inp = _varlen_inputs(lens_q, lens_k, h, hk, d, torch.bfloat16, "cuda", sinks=sinks, seed=300 + i)
        eager, comp = _varlen_run(fn, inp), _varlen_run(compiled, inp)
        _check_varlen(f"eager@{lens_q}", eager, inp, torch.bfloat16, window, True, precision=precision)
        _check_varlen(f"compiled@{lens_q}", comp, inp, torch.bfloat16, window, True, eager=eager, precision=precision)
        assert torch.equal(comp[0], eager[0]) and torch.equal(comp[1], eager[1])
    assert counter.frame_count == 1
    ops = _flashsink_ops(counter)
    assert any("flashsink.varlen_fwd" in t for t in ops), f"the kernels' op is not in the graph: {sorted(_ops_in(counter))}"


@pytest.mark.gpu
@pytest.mark.parametrize("sinks, window, causal, precision", VARLEN_OPCHECK_CASES)
def test_opcheck_varlen_gpu(sinks, window, causal, precision):
    """Fake vs real, schema, autograd registration, AOT dispatch of the varlen ops on the kernels
    (deterministic: opcheck compares runs of the backward)."""
    lens_q, lens_k = (150, 0, 7, 300), (150, 40, 7, 500)
    inp, args = _varlen_op_args("cuda", torch.bfloat16, sinks, window, causal, lens_q, lens_k, d=64,
                                deterministic=True, precision=precision)
    _opcheck_varlen(inp, args, rows=varlen_rows(sum(lens_q)))


# ------------------------------------------------------------------------------------------------
# KV cache: flashsink.attention_kvcache compiled, and the op flashsink::kvcache_fwd (forward only)

# (lengths, page size or None for a contiguous cache, seq_q) per call of one compiled graph: new lengths,
# batch, page size, number of pages and max_pages (a contiguous cache: a new S_max), an empty row in the
# second. No size of the first call equals another (dynamo's duck sizing would guard on that and
# recompile); sizes 0 and 1 are specialized by dynamo, so S_q = 1 (decode) stays 1.
KV_CALLS = {
    "paged": [((50, 17, 3), 12), ((70, 0, 2, 40, 100), 7)],
    "contiguous": [((20, 5, 37), None), ((9, 60, 33, 0, 14), None)],
}
# cache, seq_q per call, window, sinks, return_lse
KV_COMPILE_CASES = [
    ("paged", (1, 1), None, True, True),
    ("paged", (4, 6), 20, False, False),
    ("contiguous", (1, 1), 7, True, False),
    ("contiguous", (4, 6), None, True, True),
]


def _kv_cache(lengths, page_size, seq_q, window, sinks, h, hk, d, dtype, device, seed):
    from gpu_cases import KVCase
    from test_kvcache_gpu import make_cache

    return make_cache(KVCase(h, hk, d, dtype, lengths, page_size, seq_q=seq_q, window=window, sinks=sinks),
                      seed=seed, device=device)


def _kv_reference(inp, window, compute_dtype):
    cast = (lambda t: t.double()) if compute_dtype == torch.float64 else (lambda t: t)
    return flashsink.reference.attention_kvcache(
        *(cast(inp[n]) for n in ("q", "k_cache", "v_cache")), inp["cache_seqlens"], block_table=inp["block_table"],
        sinks=None if inp["sinks"] is None else cast(inp["sinks"]), window=window, layout=inp["layout"],
        return_lse=True, compute_dtype=compute_dtype)


def _kv_compiled_vs_eager(counter, calls, window, return_lse, dims, device, lowp):
    """``flashsink.attention_kvcache`` compiled (fullgraph, dynamic) over ``calls``: the same tensors as the
    eager call, bitwise (the same implementation behind the op), and o (and lse) against the float64
    reference under the precision standard (gate 2 with the reference in the input dtype when ``lowp``)."""

    def fn(q, k_cache, v_cache, cache_seqlens, block_table, sinks, layout):
        return flashsink.attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=block_table, sinks=sinks,
                                           window=window, layout=layout, return_lse=return_lse)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    dtype = dims[-1]
    for i, (lengths, page_size, seq_q, sinks) in enumerate(calls):
        inp = _kv_cache(lengths, page_size, seq_q, window, sinks, *dims, device, seed=40 + i)
        with torch.inference_mode():
            comp, eager = compiled(**inp), fn(**inp)
        comp, eager = ((comp, eager) if return_lse else ((comp,), (eager,)))
        expected = _kv_reference(inp, window, torch.float64)
        low = _kv_reference(inp, window, dtype) if lowp else (None, None)
        names = ("o", "lse")[: len(comp)]
        _assert_all([testing.check_precision(f"{nm}@{lengths}", c, e, dtype, lowp=lo)
                     for nm, c, e, lo in zip(names, comp, expected, low)])
        assert comp[0].dtype == dtype and all(torch.equal(c, e) for c, e in zip(comp, eager))
        assert comp[-1].shape == (len(lengths), dims[0], seq_q) or not return_lse
    assert counter.frame_count == 1  # one graph for every call (a recompile would have raised)
    assert any("flashsink.kvcache_fwd" in t for t in _flashsink_ops(counter)), sorted(_ops_in(counter))


@pytest.mark.parametrize("case", KV_COMPILE_CASES, ids=lambda c: "{}-Q{}-W{}-{}{}".format(
    c[0], c[1][0], c[2], "sink" if c[3] else "nosink", "-lse" if c[4] else ""))
def test_kvcache_fullgraph_dynamic_cpu(counter, case):
    """attention_kvcache compiled on CPU tensors (the op's implementation there: the reference, the values of
    the lengths and pages read inside the op): one graph for new lengths, batch, page size and page count."""
    cache, seq_qs, window, sinks, return_lse = case
    if case is not KV_COMPILE_CASES[0]:  # inductor for one case; AOT autograd alone for the others
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
    calls = [(lens, ps, sq, sinks) for (lens, ps), sq in zip(KV_CALLS[cache], seq_qs)]
    _kv_compiled_vs_eager(counter, calls, window, return_lse, (8, 2, 16, torch.bfloat16), "cpu", lowp=True)


_KV_TENSORS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "sinks")  # the op's tensor arguments
# page size or None, seq_q, window, sinks
KV_OPCHECK_CASES = [(12, 1, None, True), (12, 4, 20, False), (None, 1, 7, False), (None, 4, None, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=testing.dtype_name)
@pytest.mark.parametrize("page_size, seq_q, window, sinks", KV_OPCHECK_CASES)
def test_opcheck_kvcache_cpu(dtype, page_size, seq_q, window, sinks):
    inp = _kv_cache((50, 17, 3), page_size, seq_q, window, sinks, 8, 2, 16, dtype, "cpu", seed=9)
    inp["v_cache"] = torch.randn(*inp["k_cache"].shape[:3], 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = (*(inp[n] for n in _KV_TENSORS), window, 0.3, inp["layout"])
    torch.library.opcheck(torch.ops.flashsink.kvcache_fwd.default, args)
    o, lse = torch.ops.flashsink.kvcache_fwd(*args)
    want_o, want_lse = flashsink.reference.attention_kvcache(*args[:4], block_table=inp["block_table"],
                                                             sinks=inp["sinks"], window=window, scale=0.3,
                                                             layout="bshd", return_lse=True)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def test_kvcache_fake_shapes_and_checks():
    """The fake (meta tensors through attention_kvcache): o [B, S_q, H, D_v] contiguous in q's dtype, lse
    float32 [B, H, S_q]. The op checks its arguments as attention_kvcache does, the values (off CUDA) inside
    it, also when compiled; and it is forward only: an input that requires grad is refused eagerly, compiled
    (the door's NotImplementedError, raised while tracing) and by the op itself."""
    q = torch.empty(3, 5, 8, 64, dtype=torch.bfloat16, device="meta")
    kc = torch.empty(20, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    vc = torch.empty(20, 16, 2, 32, dtype=torch.bfloat16, device="meta")
    lens, table = (torch.empty(s, dtype=torch.int32, device="meta") for s in ((3,), (3, 4)))
    o, lse = flashsink.attention_kvcache(q, kc, vc, lens, block_table=table, layout="bshd", return_lse=True)
    assert o.shape == (3, 5, 8, 32) and o.dtype == torch.bfloat16 and o.is_contiguous() and o.is_meta
    assert lse.shape == (3, 8, 5) and lse.dtype == torch.float32 and lse.is_contiguous()
    o, lse = flashsink.attention_kvcache(*(t.transpose(1, 2) for t in (q, kc, vc)), lens, block_table=table,
                                         return_lse=True)  # "bhsd", the default: o [B, H, S_q, D_v]
    assert o.shape == (3, 8, 5, 32) and o.is_contiguous() and lse.shape == (3, 8, 5)
    with pytest.raises(ValueError, match=r"block_table must be \[B, max_pages\]"):
        torch.ops.flashsink.kvcache_fwd(q, kc, vc, lens, table[:2], None, None, 0.125, "bshd")

    inp = _kv_cache((50, 17, 3), 12, 4, None, True, 8, 2, 16, torch.float32, "cpu", seed=11)

    def fn(q, k_cache, v_cache, cache_seqlens, block_table, sinks, layout):
        return flashsink.attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=block_table, sinks=sinks,
                                           layout=layout)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inp), fn(**inp), rtol=0, atol=0)
        bad = dict(inp, cache_seqlens=torch.tensor([50, 85, 3], dtype=torch.int32))
        for f in (compiled, fn):
            with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 85 must be in \[0, 84\]"):
                f(**bad)
    grad = dict(inp, sinks=inp["sinks"].requires_grad_(True))
    with pytest.raises(NotImplementedError, match="forward only.*sinks requires grad"):
        fn(**grad)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:  # fullgraph: the door's error, observed while tracing
        compiled(**grad)
    cause = repr(info.value.__cause__)  # torch 2.13 keeps the door's text; 2.11 (the GPU host's) only its type
    assert "sinks requires grad" in cause or "NotImplementedError" in cause, cause
    with pytest.raises(NotImplementedError, match="forward only.*sinks requires grad"):
        torch.ops.flashsink.kvcache_fwd(*(grad[n] for n in _KV_TENSORS), None, 0.25, "bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_kvcache_fullgraph_dynamic_gpu(counter, cache):
    """attention_kvcache on CUDA compiled (fullgraph, dynamic, inductor) over two calls: o and lse bitwise
    the eager kernels' (the op's CUDA implementation is the same launches), and under the precision standard
    against the float64 reference; one graph. The configurations are tests/gpu_cases.py's kvcache_cases
    ("decode-p16": bf16, G8, D64, sinks; "chunk16-contiguous": fp16, G3, D64, sinks), which the GPU suite
    precompiles (tools/gpu_kernels.py): no new kernels."""
    if cache == "paged":  # decode (S_q = 1), page size and page count new in the second call
        dims, window = (64, 8, 64, torch.bfloat16), None
        calls = [((3000, 777, 2), 48, 1, True), ((100, 5000, 9, 1, 257), 16, 1, True)]
    else:  # prefill chunks against a contiguous cache, window 64
        dims, window = (12, 4, 64, torch.float16), 64
        calls = [((4000, 100), None, 16, True), ((300, 2000, 77), None, 9, True)]
    _kv_compiled_vs_eager(counter, calls, window, True, dims, "cuda", lowp=False)


# ------------------------------------------------------------------------------------------------
# The ops check their arguments in their implementations, the fake ones included (issue 52: no check
# before torch's schema). torch 2.11's Dynamo (the GPU host's) runs an op on its fake values, where a
# scale computed from a dynamic head dim is a SymFloat: the fakes must accept what a trace passes. A
# compiled call with a bad shape is refused while tracing, by the fake, with the public message.


def test_fake_refuses_a_bad_shape_while_tracing(counter):
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    do = torch.randn(1, 2, 8, 8)  # v's head dim is 16: do must be [1, 2, 8, 16]

    def bwd(do, q, k, v):
        o, lse = torch.ops.flashsink.fwd(q, k, v, None, None, True, 0.25, "bhsd", False)
        return torch.ops.flashsink.bwd(do, q, k, v, None, lse, None, None, True, 0.25, "bhsd", False, "fast", o)

    with pytest.raises(ValueError, match=r"^do must be a torch.float32 tensor of shape \[1, 2, 8, 16\]"):
        bwd(do, q, k, v)
    compiled = torch.compile(bwd, backend=counter, fullgraph=True, dynamic=True)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError) as info:
        compiled(do, q, k, v)
    assert "do must be a torch.float32 tensor" in str(info.value) or "ValueError" in repr(info.value.__cause__)
