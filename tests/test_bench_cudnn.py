"""The `cudnn` bench peer on the CPU: registered, listed, unavailable with its reason without cuDNN or CUDA,
and its plumbing (graph tensors, strides, masks, sink, ragged offsets, autograd) through a fake `cudnn`
module that executes the graphs it is given with cuDNN's own mask formulas (cudnn-frontend
test/python/sdpa/fp16_ref.py), so the gate proves the peer's window / causal / sink mapping."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from flashsink import bench
from flashsink.bench import cudnn_peer

pytestmark = pytest.mark.l1


# ----------------------------------------------------------------------------------------------
# A fake cudnn-frontend: the graph API's calls, executed in float64 on the CPU


class _T:
    """A graph tensor: dims, strides, dtype, uid, ragged offset."""

    def __init__(self, dim=None, stride=None, data_type=None, name="", uid=None):
        self.dim, self.stride, self.data_type, self.name, self.uid = dim, stride, data_type, name, uid
        self.ragged = None
        self.output = False

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, dt):
        self.data_type = dt
        return self

    def set_ragged_offset(self, t):
        self.ragged = t
        return self


_TORCH = {"HALF": torch.float16, "BFLOAT16": torch.bfloat16, "FLOAT": torch.float32, "INT32": torch.int32,
          "INT64": torch.int64}
SDPA_KWARGS = {"attn_scale", "generate_stats", "sink_token", "diagonal_alignment", "diagonal_band_left_bound",
               "diagonal_band_right_bound", "use_padding_mask", "seq_len_q", "seq_len_kv", "name"}
BWD_KWARGS = SDPA_KWARGS - {"generate_stats"} | {"dSink_token", "max_total_seq_len_q", "max_total_seq_len_kv"}


class _Graph:
    builds: list = []  # every graph built, for the tests to inspect

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None):
        assert intermediate_data_type == compute_data_type == "FLOAT" and handle is not None
        self.io, self.op, self.steps = io_data_type, None, []
        _Graph.builds.append(self)

    def tensor(self, dim, stride, data_type, name="", uid=None):
        assert len(dim) == len(stride) == 4 and uid is not None
        return _T(list(dim), list(stride), data_type, name, uid)

    def sdpa(self, q, k, v, **kw):
        assert set(kw) <= SDPA_KWARGS, set(kw) - SDPA_KWARGS
        self.op = ("fwd", dict(q=q, k=k, v=v, **kw), (_T(), _T()))
        return self.op[2]

    def sdpa_backward(self, q, k, v, o, dO, stats, **kw):
        assert set(kw) <= BWD_KWARGS, set(kw) - BWD_KWARGS
        self.op = ("bwd", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, **kw), (_T(), _T(), _T()))
        return self.op[2]

    def validate(self):
        self.steps.append("validate")

    def build_operation_graph(self):
        self.steps.append("build_operation_graph")

    def check_support(self):
        self.steps.append("check_support")

    def build_plans(self):
        self.steps.append("build_plans")

    def create_execution_plans(self, modes):
        assert modes == ["A", "FALLBACK"]
        self.steps.append("create_execution_plans")

    def get_workspace_size(self):
        return 64

    # -- execution

    def execute(self, pack, workspace, handle=None):
        with torch.no_grad():  # writes into the outputs as a kernel does, outside autograd
            self._execute(pack, workspace)

    def _execute(self, pack, workspace):
        assert self.steps == ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                              "build_plans"] and workspace.numel() == 64
        kind, a, outs = self.op
        lens = None
        if a.get("use_padding_mask"):
            lens = pack[a["seq_len_q"].uid].flatten().tolist(), pack[a["seq_len_kv"].uid].flatten().tolist()
            assert lens[0] == lens[1]

        def view(t, b, ragged_uid=None):
            """Batch b of tensor t: [1, H, S, D] over the bound data (declared dims, strides, ragged offset)."""
            data = pack[t.uid]
            assert data.dtype == _TORCH[t.data_type], (t.name, data.dtype, t.data_type)
            _, h, s, d = t.dim
            if t.ragged is not None:
                off = int(pack[t.ragged.uid].flatten()[b])
                s = lens[0][b]
                assert off + (s - 1) * t.stride[2] + (h - 1) * t.stride[1] + d <= data.numel()
                return data.as_strided((1, h, s, d), [0, *t.stride[1:]], data.storage_offset() + off)
            for n, st, dim in zip(range(4), data.stride(), data.shape):  # the data is laid out as declared
                assert dim == t.dim[n] and (dim == 1 or st == t.stride[n]), (t.name, data.stride(), t.stride)
            if lens is not None:
                s = lens[0][b]
            return data[b:b + 1, :, :s]

        sink = pack[a["sink_token"].uid]
        assert sink.shape == (1, a["q"].dim[1], 1, 1) and sink.dtype == torch.float32
        for b in range(a["q"].dim[0]):
            with torch.enable_grad():  # the fake's own autograd, for the backward
                q, k, v = (view(a[n], b).double().requires_grad_(True) for n in ("q", "k", "v"))
                s_ = sink.double().reshape(1, -1, 1, 1).requires_grad_(True)
                o, lse = self._attend(a, q, k, v, s_)
            if kind == "fwd":
                view(outs[0], b).copy_(o)
                view(outs[1], b).copy_(lse)
                continue
            view(a["o"], b), view(a["stats"], b)  # bound, typed and laid out as declared
            do = view(a["dO"], b).double()
            dq, dk, dv, ds = torch.autograd.grad(o, (q, k, v, s_), do)
            for t, x in zip(outs, (dq, dk, dv)):
                view(t, b).copy_(x)
            pack[a["dSink_token"].uid].add_(ds.float())  # accumulates, as an engine with atomics: must be zeroed

    @staticmethod
    def _attend(a, q, k, v, sink):
        """softmax([scale q k^T masked, sink]) v, and its lse, with fp16_ref.py's masks."""
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = a["attn_scale"] * q @ k.transpose(-1, -2)
        sq, skv = s.shape[-2:]
        off = skv - sq if str(a.get("diagonal_alignment")) == "BOTTOM_RIGHT" else 0
        hide = torch.zeros(sq, skv, dtype=torch.bool)
        if a.get("diagonal_band_right_bound") is not None:
            hide |= torch.ones(sq, skv, dtype=torch.bool).triu_(off + 1 + a["diagonal_band_right_bound"])
        if a.get("diagonal_band_left_bound") is not None:
            hide |= torch.ones(sq, skv, dtype=torch.bool).tril_(off - a["diagonal_band_left_bound"])
        s = s.masked_fill(hide, float("-inf"))
        full = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
        lse = torch.logsumexp(full, -1, keepdim=True)
        return torch.exp(s - lse) @ v, lse


def _fake_cudnn(monkeypatch, backend=91900):
    mod = types.ModuleType("cudnn")
    mod.__version__ = "1.32.0"
    mod.backend_version = lambda: backend
    mod.backend_version_string = lambda: f"{backend // 10000}.{backend // 100 % 100}.{backend % 100}"
    mod.data_type = types.SimpleNamespace(**{n: n for n in _TORCH})
    mod.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    mod.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT", BOTTOM_RIGHT="BOTTOM_RIGHT")
    mod.cudnnGraphNotSupportedError = type("cudnnGraphNotSupportedError", (RuntimeError,), {})
    mod.pygraph = _Graph
    mod.create_handle = lambda: object()
    mod.streams = []
    mod.set_stream = lambda handle, stream: mod.streams.append(stream)
    monkeypatch.setitem(sys.modules, "cudnn", mod)
    monkeypatch.setattr(_Graph, "builds", [])
    return mod


class CudnnCPU(bench.Cudnn):
    def check_available(self, device):
        pass


def _run(problems, modes=bench.MODES, systems=("cudnn",)):
    return bench.run_bench(problems, systems=list(systems), modes=list(modes), device="cpu",
                           timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))


# ----------------------------------------------------------------------------------------------


def test_cudnn_is_a_registered_peer_next_to_fa4():
    names = list(bench.SYSTEMS)
    assert names[names.index("fa4") + 1] == "cudnn" and bench.SYSTEMS["cudnn"] is bench.Cudnn
    c = bench.Cudnn()
    assert c.peer and c.has_sink and c.required_gate is None


def test_cudnn_unavailable_without_the_module_or_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import fails
    with pytest.raises(bench.Unavailable, match=r"import cudnn.*nvidia-cudnn-frontend"):
        bench.Cudnn().check_available("cuda")
    mod = _fake_cudnn(monkeypatch)
    with pytest.raises(bench.Unavailable, match="CUDA only"):
        bench.Cudnn().check_available("cpu")
    c = bench.Cudnn()
    c.check_available("cuda")  # the fake says 9.19
    assert c.version == "cuDNN 9.19.0, frontend 1.32.0"
    mod.backend_version, mod.backend_version_string = (lambda: 91200), (lambda: "9.12.0")
    with pytest.raises(bench.Unavailable, match=r"cuDNN 9.12.0 has no learnable sink.*>= 9.13"):
        bench.Cudnn().check_available("cuda")

    def broken():
        raise OSError("libcudnn.so.9: cannot open shared object file")

    mod.backend_version = broken
    with pytest.raises(bench.Unavailable, match="did not load: OSError: libcudnn"):
        bench.Cudnn().check_available("cuda")


def test_cudnn_row_on_cpu_says_why():
    """Without cuDNN here (or on --device cpu) every mode's row is unavailable with the reason, never gated."""
    res = _run([bench.parse_shape("1,2,1,32,16", "fp32")], systems=("flashsink", "cudnn"))
    rows = [r for r in res["rows"] if r["system"] == "cudnn"]
    assert len(rows) == 3 and all(r["status"].startswith("unavailable: ") and r["ms"] is None for r in rows)
    assert [g["system"] for g in res["gates"]] == ["flashsink"]


def test_cudnn_problems_it_cannot_run(monkeypatch):
    mod = _fake_cudnn(monkeypatch)
    c = CudnnCPU()
    with pytest.raises(bench.Unavailable, match="fp16 / bf16 inputs, not fp32"):
        c.check_problem(bench.parse_shape("1,2,1,32,16", "fp32"), "cpu", {})
    assert not _Graph.builds  # refused before building anything

    def refuse(self):
        raise mod.cudnnGraphNotSupportedError("No valid engine configs for SDPA_BWD\nmore")

    monkeypatch.setattr(_Graph, "check_support", refuse)
    p = bench.parse_shape("1,2,1,32,16", "bf16")
    with pytest.raises(bench.Unavailable, match=r"^n/a: cuDNN has no engine for the fwd graph: "
                                                r"cudnnGraphNotSupportedError: No valid engine configs for SDPA_BWD$"):
        c.check_problem(p, "cpu", {"grads": True})
    monkeypatch.setattr(_Graph, "check_support", lambda self: (_ for _ in ()).throw(RuntimeError("bad stride")))
    with pytest.raises(bench.Unavailable, match="n/a: cuDNN failed to build the fwd graph: RuntimeError: bad stride"):
        c.check_problem(p, "cpu", {})


@pytest.mark.parametrize("shape", ["2,4,2,48,16", "1,4,2,64,16,9", "2,4,4,20:52,16", "1,4,2,24:40,16,7",
                                   "1,4,1,33,8,1"])
def test_cudnn_plumbing_gates_strict_through_the_fake(monkeypatch, shape):
    """Dense problems (GQA, windows, S_q < S_kv bottom-right, window 1) run fwd, bwd and fwd+bwd through the
    fake's graphs and pass the strict gate: mask bounds, alignment, sink and dsink, layouts round-trip."""
    _fake_cudnn(monkeypatch)
    monkeypatch.setitem(bench.SYSTEMS, "cudnn", CudnnCPU)
    res = _run([bench.parse_shape(shape, "bf16")])
    for r in res["rows"]:
        assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
    fwd = [g for g in _Graph.builds if g.op[0] == "fwd"]
    assert len(fwd) == 1 and len(_Graph.builds) == 2  # one graph per kind and problem, reused by every call
    a = fwd[0].op[1]
    parts = shape.split(",")
    h, hk, d = int(parts[1]), int(parts[2]), int(parts[4])
    assert a["q"].stride == [a["q"].dim[2] * h * d, d, h * d, 1]  # [B, S, H, D] memory
    assert a["k"].dim[1] == hk and a["sink_token"].dim == [1, h, 1, 1] and a["generate_stats"] is True
    sq, skv = a["q"].dim[2], a["k"].dim[2]
    assert a["diagonal_band_right_bound"] == 0
    assert a["diagonal_alignment"] == ("BOTTOM_RIGHT" if sq != skv else "TOP_LEFT")
    assert a.get("diagonal_band_left_bound") == (int(parts[5]) if len(parts) == 6 else None)


def test_cudnn_noncausal_and_decode_have_no_mask(monkeypatch):
    _fake_cudnn(monkeypatch)
    monkeypatch.setitem(bench.SYSTEMS, "cudnn", CudnnCPU)
    dec = bench.preset_problems("decode", tiny=True)[0]
    nc = bench.parse_shape("1,4,2,24:40,16", "fp16", causal=False)
    res = _run([dec, nc])
    for r in res["rows"]:
        if r["status"] != bench.FORWARD_ONLY:
            assert r["status"] == "ok" and r["gate"] == "strict", r
    for g in _Graph.builds:
        assert not {"diagonal_band_right_bound", "diagonal_band_left_bound"} & set(g.op[1])


def test_cudnn_varlen_is_ragged(monkeypatch):
    """The packed batch runs as ragged THD tensors: lengths, offsets in elements, backward with the
    total's bound; it passes the strict gate forward and backward, windowed and full."""
    _fake_cudnn(monkeypatch)
    monkeypatch.setitem(bench.SYSTEMS, "cudnn", CudnnCPU)
    probs = bench.preset_problems("varlen", tiny=True)
    res = _run(probs)
    for r in res["rows"]:
        assert r["status"] == "ok" and r["gate"] == "strict", r
    p = probs[0]
    bwd = next(g for g in _Graph.builds if g.op[0] == "bwd").op[1]
    assert bwd["use_padding_mask"] and bwd["max_total_seq_len_q"] == -(-p.tokens_q // 64) * 64
    assert bwd["q"].dim == [len(p.seqlens), p.heads, max(p.seqlens), p.head_dim] and bwd["q"].ragged is not None
    t = CudnnCPU().prepare(bench.make_problem_inputs(p, "cpu", 0), p)
    cu = [0, *torch.tensor(p.seqlens).cumsum(0).tolist()]
    assert t["_cudnn"][cudnn_peer.RAG_Q].flatten().tolist() == [c * p.heads * p.head_dim for c in cu]
    assert t["_cudnn"][cudnn_peer.RAG_KV].flatten().tolist() == [c * p.kv_heads * p.head_dim for c in cu]
    assert t["_cudnn"][cudnn_peer.RAG_STATS].flatten().tolist() == [c * p.heads for c in cu]
    assert t["_cudnn"][cudnn_peer.SEQ_Q].flatten().tolist() == list(p.seqlens)


def test_cudnn_wrong_mapping_fails_the_gate(monkeypatch):
    """The fake is strict enough to catch a wrong window bound: W - 1 (FlashAttention's left size) fails."""
    _fake_cudnn(monkeypatch)

    class OffByOne(CudnnCPU):
        def _mask(self, prob):
            kw = super()._mask(prob)
            kw["diagonal_band_left_bound"] -= 1
            return kw

    monkeypatch.setitem(bench.SYSTEMS, "cudnn", OffByOne)
    res = _run([bench.parse_shape("1,4,2,64,16,9", "bf16")], modes=["fwd"])
    assert res["rows"][0]["gate"] == "none"


def test_cudnn_stack_runs_through_the_fake(monkeypatch):
    """The gpt-oss stack (layers chained, varlen): each layer's output is the next ragged query."""
    _fake_cudnn(monkeypatch)
    monkeypatch.setitem(bench.SYSTEMS, "cudnn", CudnnCPU)
    res = _run(bench.preset_problems("gptoss-stack-4k", tiny=True), modes=["fwd+bwd"])
    assert [r["gate"] for r in res["rows"]] == ["strict"], res["rows"]


def test_cli_lists_and_accepts_cudnn(tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "flashsink", "bench", *args], capture_output=True, text=True,
                              env=env, timeout=600)

    r = cli("--help")
    assert r.returncode == 0 and "subset of flashsink," in " ".join(r.stdout.split())
    assert "fa4, cudnn, flex" in " ".join(r.stdout.split())
    out = tmp_path / "b.json"
    r = cli("--device", "cpu", "--shape", "1,2,1,32,16", "--systems", "cudnn,flashsink", "--mode", "fwd",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["system"] == "cudnn" and rows[0]["status"].startswith("unavailable: ")
    r = cli("--device", "cpu", "--systems", "cudnn2")
    assert r.returncode == 2 and "'cudnn'" in r.stderr
