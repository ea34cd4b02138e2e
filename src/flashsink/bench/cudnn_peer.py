"""cuDNN's fused attention with a learnable sink as a bench peer (issue 55), through the cudnn-frontend
graph API (``pip install nvidia-cudnn-frontend``; cuDNN >= 9.13 for the sink, forward and backward):

    o, stats = graph.sdpa(q, k, v, attn_scale=, generate_stats=True, diagonal_alignment=,
                          diagonal_band_left_bound=W, diagonal_band_right_bound=0, sink_token=sink)
    dq, dk, dv = graph.sdpa_backward(q, k, v, o, dO, stats, ..., sink_token=sink, dSink_token=dsink)

with the sink a float32 ``[1, H, 1, 1]`` tensor. Masks, as cudnn-frontend's reference writes them
(test/python/sdpa/fp16_ref.py): the right bound 0 keeps keys ``j <= i + (S_kv - S_q)`` under BOTTOM_RIGHT
alignment (our causal), the left bound L keeps ``j > i + (S_kv - S_q) - L``, so L = W gives our window
``[i-W+1, i]``. Tensors are [B, H, S, D] dims over [B, S, H, D] memory (cuDNN takes any strides; BSHD is
what its users hand it); K / V keep their H_kv heads (GQA is native, dK / dV come out per KV head). Varlen
runs the packed [total, H, D] batch as ragged (THD) tensors: offsets ``cu_seqlens * H * D`` elements,
``seq_len_q`` / ``seq_len_kv`` the lengths, the padding mask on.

Each graph is built once per problem (:meth:`Cudnn.check_problem`, so a graph cuDNN does not support is an
``n/a`` row with its reason) and cached with its workspace; the timed calls only execute it. The forward
always writes the stats (the backward's input), as FA4's returns its lse.
"""

from __future__ import annotations

import importlib

import torch

from .problems import Problem
from .system import System, Unavailable, all_visible

MIN_BACKEND = 91300  # cuDNN 9.13: the fused attention's sink_token / dSink_token
_IO_TYPES = {"fp16": "HALF", "bf16": "BFLOAT16"}
# variant-pack uids (any distinct integers)
Q, K, V, O, STATS, SINK, DO, DQ, DK, DV, DSINK = range(1, 12)
SEQ_Q, SEQ_KV, RAG_Q, RAG_KV, RAG_O, RAG_STATS = range(20, 26)
_RAGGED_ROWS = 64  # the backward's max_total_seq_len_*: the total rounded up to 64, as cudnn-frontend's THD tests


def _bshd(b: int, h: int, s: int, d: int) -> list[int]:
    """Strides of [B, H, S, D] dims over [B, S, H, D] memory."""
    return [s * h * d, d, h * d, 1]


def _stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


class _SinkAttention(torch.autograd.Function):
    """cuDNN's forward graph, and its backward graph for the gradients (dsink included)."""

    @staticmethod
    def forward(ctx, peer, prob, extra, q, k, v, sinks):
        o, stats = peer.run_forward(prob, extra, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, sinks, o, stats)
        ctx.peer, ctx.prob, ctx.extra = peer, prob, extra
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, sinks, o, stats = ctx.saved_tensors
        dq, dk, dv, dsink = ctx.peer.run_backward(ctx.prob, ctx.extra, q, k, v, sinks, o, stats, do)
        return None, None, None, dq, dk, dv, dsink


class Cudnn(System):
    """cuDNN's fused attention (cudnn-frontend graphs) with its learnable sink; see the module docstring."""

    name = "cudnn"
    peer = True
    note = "cudnn graph sdpa(sink_token=) + sdpa_backward(dSink_token=), bshd strides"
    MODULE = "cudnn"

    def __init__(self):
        self._handle = None
        self._graphs: dict = {}  # (kind, problem geometry) -> (graph, workspace)
        self.version = ""  # "cuDNN 9.19.0, frontend 1.32.0", once check_available passed

    def _lib(self):
        return importlib.import_module(self.MODULE)

    def check_available(self, device):
        try:
            cudnn = self._lib()
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"`import {self.MODULE}` failed (pip install nvidia-cudnn-frontend): "
                              f"{type(exc).__name__}: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (cuDNN)")
        try:
            backend, text = int(cudnn.backend_version()), cudnn.backend_version_string()
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"the cuDNN library did not load: {type(exc).__name__}: {exc}") from None
        if backend < MIN_BACKEND:
            raise Unavailable(f"cuDNN {text} has no learnable sink in its fused attention (needs >= 9.13)")
        self.version = f"cuDNN {text}, frontend {getattr(cudnn, '__version__', '?')}"

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return "cudnn graph sdpa(sink_token=), ragged THD (seq_len_q/kv, offsets), packed"
        return self.note

    def check_problem(self, prob, device, opts):
        if prob.dtype not in _IO_TYPES:
            raise Unavailable(f"n/a: cuDNN's fused attention takes fp16 / bf16 inputs, not {prob.dtype}")
        if prob.window is not None and not prob.causal:
            raise Unavailable("n/a: the peer maps a window only with the causal mask (the bench's problems)")
        # Build the graphs now, outside any timing: one cuDNN does not serve is n/a with its reason.
        for kind in ("fwd", "bwd") if opts.get("grads") else ("fwd",):
            try:
                self._graph(prob, kind, device)
            except Exception as exc:  # noqa: BLE001 -- cuDNN's refusal is this problem's n/a, said in its words
                cudnn = self._lib()
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                what = ("has no engine for" if isinstance(exc, getattr(cudnn, "cudnnGraphNotSupportedError", ()))
                        else "failed to build")
                raise Unavailable(f"n/a: cuDNN {what} the {kind} graph: {type(exc).__name__}: {msg}"[:300]) from None

    # ------------------------------------------------------------------------------------------
    # Graphs

    def _geometry(self, prob: Problem) -> tuple:
        """B, S_q, S_kv of the graph (varlen: the sequences, padded to the longest) and the total tokens."""
        if prob.seqlens is not None:
            return len(prob.seqlens), prob.seq_q, prob.seq_kv, prob.tokens_q
        return prob.batch, prob.seq_q, prob.seq_kv, None

    def _mask(self, prob: Problem) -> dict:
        cudnn = self._lib()
        if not prob.causal or all_visible(prob):  # nothing hidden (decode: the one row sees the cache)
            return {}
        bottom_right = prob.seqlens is None and prob.seq_q != prob.seq_kv  # varlen: S_q == S_kv per sequence
        kw = {"diagonal_band_right_bound": 0,
              "diagonal_alignment": getattr(cudnn.diagonal_alignment, "BOTTOM_RIGHT" if bottom_right else "TOP_LEFT")}
        if prob.window is not None:
            kw["diagonal_band_left_bound"] = prob.window  # keys j > i - W: [i-W+1, i]
        return kw

    def _graph(self, prob: Problem, kind: str, device) -> tuple:
        key = (kind, prob.batch, prob.heads, prob.kv_heads, prob.seq_q, prob.seq_kv, prob.head_dim, prob.window,
               prob.causal, prob.dtype, prob.seqlens)
        if key not in self._graphs:
            cudnn = self._lib()
            if self._handle is None:
                self._handle = cudnn.create_handle()
            g = self._build(cudnn, prob, kind)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
            self._graphs[key] = (g, ws)
        return self._graphs[key]

    def _build(self, cudnn, prob: Problem, kind: str):
        io = getattr(cudnn.data_type, _IO_TYPES[prob.dtype])
        f32 = cudnn.data_type.FLOAT
        b, sq, skv, total = self._geometry(prob)
        h, hk, d = prob.heads, prob.kv_heads, prob.head_dim
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=self._handle)

        def tensor(uid, name, dim, stride, dtype=io):
            return g.tensor(name=name, dim=dim, stride=stride, data_type=dtype, uid=uid)

        qd, kd = [b, h, sq, d], [b, hk, skv, d]
        qs, ks = _bshd(b, h, sq, d), _bshd(b, hk, skv, d)
        # stats [B, H, S_q, 1]: contiguous, or [total, H] rows when ragged
        sd, ss = [b, h, sq, 1], ([sq * h, 1, h, 1] if total is not None else [h * sq, sq, 1, 1])
        q, k, v = tensor(Q, "q", qd, qs), tensor(K, "k", kd, ks), tensor(V, "v", kd, ks)
        sink = tensor(SINK, "sink", [1, h, 1, 1], [h, 1, 1, 1], f32)
        kw = dict(attn_scale=prob.scale, sink_token=sink, **self._mask(prob))
        rag = {}
        if total is not None:
            col = [b + 1, 1, 1, 1], [1, 1, 1, 1]
            kw.update(use_padding_mask=True, seq_len_q=tensor(SEQ_Q, "seq_len_q", [b, 1, 1, 1], [1, 1, 1, 1],
                                                              cudnn.data_type.INT32),
                      seq_len_kv=tensor(SEQ_KV, "seq_len_kv", [b, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32))
            rag = {n: tensor(uid, "ragged_" + n, *col, cudnn.data_type.INT64)
                   for n, uid in (("q", RAG_Q), ("kv", RAG_KV), ("o", RAG_O), ("stats", RAG_STATS))}
            q.set_ragged_offset(rag["q"])
            k.set_ragged_offset(rag["kv"])
            v.set_ragged_offset(rag["kv"])

        def out(t, uid, dim, stride, dtype=io, ragged=None):
            t.set_uid(uid).set_output(True).set_dim(dim).set_stride(stride).set_data_type(dtype)
            if ragged is not None:
                t.set_ragged_offset(ragged)

        if kind == "fwd":
            o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **kw)
            out(o, O, qd, qs, ragged=rag.get("o"))
            out(stats, STATS, sd, ss, f32, ragged=rag.get("stats"))
            return g
        o, do = tensor(O, "o", qd, qs), tensor(DO, "dO", qd, qs)
        stats = tensor(STATS, "stats", sd, ss, f32)
        dsink = tensor(DSINK, "dsink", [1, h, 1, 1], [h, 1, 1, 1], f32)
        if total is not None:
            rows = -(-total // _RAGGED_ROWS) * _RAGGED_ROWS
            kw.update(max_total_seq_len_q=rows, max_total_seq_len_kv=rows)
            o.set_ragged_offset(rag["o"])
            do.set_ragged_offset(rag["o"])
            stats.set_ragged_offset(rag["stats"])
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                     dSink_token=dsink, **kw)
        out(dq, DQ, qd, qs, ragged=rag.get("q"))
        out(dk, DK, kd, ks, ragged=rag.get("kv"))
        out(dv, DV, kd, ks, ragged=rag.get("kv"))
        return g

    def _execute(self, prob: Problem, kind: str, pack: dict, like: torch.Tensor) -> None:
        cudnn = self._lib()
        g, ws = self._graph(prob, kind, like.device)
        cudnn.set_stream(handle=self._handle, stream=_stream(like))
        g.execute(pack, ws, handle=self._handle)

    # ------------------------------------------------------------------------------------------
    # Tensors

    def _layout(self, x: torch.Tensor, prob: Problem) -> torch.Tensor:
        """x in the graph's memory layout: packed rows (varlen) or BSHD memory; a copy only if it is not."""
        if prob.seqlens is not None:
            return x.contiguous()
        b, h, s, d = x.shape
        if x.stride() == tuple(_bshd(b, h, s, d)):
            return x
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    def _empty(self, like: torch.Tensor, prob: Problem) -> torch.Tensor:
        """An output shaped and laid out as ``like``."""
        if prob.seqlens is not None:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        b, h, s, d = like.shape
        return like.new_empty((b, s, h, d)).transpose(1, 2)

    def run_forward(self, prob, extra, q, k, v, sinks):
        """o and the stats of the forward graph."""
        b, sq, _, total = self._geometry(prob)
        o = self._empty(q, prob)
        shape = (total, prob.heads, 1) if total is not None else (b, prob.heads, sq, 1)
        stats = q.new_empty(shape, dtype=torch.float32)
        sink = sinks.detach().float().reshape(1, -1, 1, 1).contiguous()
        self._execute(prob, "fwd", {Q: q, K: k, V: v, O: o, STATS: stats, SINK: sink, **extra}, q)
        return o, stats

    def run_backward(self, prob, extra, q, k, v, sinks, o, stats, do):
        """dq, dk, dv, dsink of the backward graph (dsink shaped and typed as ``sinks``)."""
        do = self._layout(do.to(o.dtype), prob)
        dq, dk, dv = self._empty(q, prob), self._empty(k, prob), self._empty(v, prob)
        # zeroed: an engine may accumulate into it (cudnn-frontend's sm80 kernel adds its per-row sums atomically)
        dsink = torch.zeros((1, prob.heads, 1, 1), dtype=torch.float32, device=q.device)
        sink = sinks.detach().float().reshape(1, -1, 1, 1).contiguous()
        self._execute(prob, "bwd", {Q: q, K: k, V: v, O: o, DO: do, STATS: stats, SINK: sink, DQ: dq, DK: dk,
                                    DV: dv, DSINK: dsink, **extra}, q)
        return dq, dk, dv, dsink.reshape(sinks.shape).to(sinks.dtype)

    # ------------------------------------------------------------------------------------------
    # System

    def prepare(self, inp, prob):
        t = dict(inp)
        for n in ("q", "k", "v", "do"):
            t[n] = self._layout(inp[n], prob)
        t["_cudnn"] = {}
        if prob.seqlens is not None:  # the lengths and the ragged offsets (in elements) of the packed batch
            cu = inp["cu_seqlens"].to(torch.int64)
            lens = (cu[1:] - cu[:-1]).to(torch.int32).reshape(-1, 1, 1, 1)
            h, hk, d = prob.heads, prob.kv_heads, prob.head_dim
            t["_cudnn"] = {SEQ_Q: lens, SEQ_KV: lens.clone(), RAG_Q: (cu * h * d).reshape(-1, 1, 1, 1),
                           RAG_KV: (cu * hk * d).reshape(-1, 1, 1, 1), RAG_O: (cu * h * d).reshape(-1, 1, 1, 1),
                           RAG_STATS: (cu * h).reshape(-1, 1, 1, 1)}
        return t

    def forward(self, t, prob):
        q, k, v = (self._layout(t[n], prob) for n in ("q", "k", "v"))
        sinks = t["sinks"]
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, sinks)):
            return _SinkAttention.apply(self, prob, t["_cudnn"], q, k, v, sinks)
        return self.run_forward(prob, t["_cudnn"], q, k, v, sinks)[0]

    def release(self):
        self._graphs.clear()  # the graphs and their workspaces; the handle stays for the next problem
