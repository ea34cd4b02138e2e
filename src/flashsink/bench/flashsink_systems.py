"""flashsink's own rows: eager calls (fast, strict), CUDA-graph replays, and the KV-cache decode path."""

from __future__ import annotations

import torch

from .system import System, Unavailable


class FlashSink(System):
    """flashsink's eager calls, ``precision=self.precision`` and ``deterministic=self.deterministic``; it
    must pass that precision's gate."""

    name = "flashsink"
    precision = "fast"
    deterministic = False
    note = 'precision="fast" (the default)'

    @property
    def required_gate(self):
        return self.precision

    def forward(self, t, prob):
        import flashsink

        det = {"deterministic": True} if self.deterministic else {}  # else the call exactly as users make it
        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            return flashsink.attention_varlen(t["q"], t["k"], t["v"], cu, cu, m, m, t["sinks"], window=prob.window,
                                              causal=prob.causal, scale=prob.scale, precision=self.precision, **det)
        return flashsink.attention(t["q"], t["k"], t["v"], t["sinks"], window=prob.window,
                                   causal=prob.causal, scale=prob.scale, precision=self.precision, **det)


class FlashSinkStrict(FlashSink):
    name = "flashsink-strict"
    precision = "strict"
    note = 'precision="strict"'


class FlashSinkDet(FlashSink):
    """``deterministic=True`` (fast): the backward without atomics, dK/dV in the main kernel and dQ in a
    second, query-stationary pass written straight in the input dtype (no fp32 accumulator, its fill
    or its cast), the sink gradient from per-program partials. What bitwise reproducibility costs, and
    on windows, where a query tile's dQ comes from two or three KV tiles, whether that route is the
    faster one."""

    name = "flashsink-det"
    deterministic = True
    note = 'deterministic=True (fast): dQ in its own atomic-free pass'


class FlashSinkGraph(FlashSink):
    """flashsink captured in CUDA graphs and replayed: the kernels' time without the host's (Python,
    validation, dispatch, launches), next to the eager ``flashsink`` row. Three graphs, following
    torch's CUDA-graph recipe (warm-up on a side stream, static inputs and output gradient):

    - fwd: the forward under ``no_grad``;
    - fwd+bwd: forward and ``torch.autograd.grad`` captured together (whole-network capture);
    - bwd: the forward run once on the capture stream outside the graph, its backward captured
      (autograd runs a backward op on its forward op's stream, so both use the same stream).

    The gate judges a replay of each graph, with every output filled with NaN before it, and the
    timing replays those same graphs.
    """

    name = "flashsink-graph"
    note = "flashsink (fast) replayed from a CUDA graph: kernel time, no host overhead"

    cuda_only = "CUDA only (CUDA graphs)"
    no_varlen = ("n/a: attention_varlen checks cu_seqlens on the host (a device-to-host copy each call), which a "
                 "CUDA graph cannot capture")

    def __init__(self):
        self._graphs: dict = {}

    def release(self):
        self._graphs = {}

    def _capture(self, inp, prob, grads: bool) -> dict:
        """mode -> (graph, {result name: static output tensor})."""
        self.release()
        t = self.prepare(inp, prob)
        names = self.leaves(t)
        for n in names:  # static inputs: the graphs read these tensors' memory
            t[n] = t[n].detach().clone().requires_grad_(True)
        leaves = [t[n] for n in names]
        keys = ["dsink" if n == "sinks" else "d" + n for n in names]
        do = t["do"].to(prob.torch_dtype).clone()  # static output gradient (o has q's dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: first-call work (compiles, allocator) outside capture
            for _ in range(2):
                with torch.no_grad():
                    self.forward(t, prob)
                if grads:
                    torch.autograd.grad(self.forward(t, prob), leaves, do)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs, kept = {}, None
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            o = self.forward(t, prob)
        graphs["fwd"] = (g, {"o": o})
        if grads:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                o = self.forward(t, prob)
                gr = torch.autograd.grad(o, leaves, do)
            graphs["fwd+bwd"] = (g, {"o": o, **dict(zip(keys, gr))})
            with torch.cuda.stream(side):
                kept = self.forward(t, prob)  # its autograd graph (saved tensors) serves every replay
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                gr = torch.autograd.grad(kept, leaves, do, retain_graph=True)
            graphs["bwd"] = (g, dict(zip(keys, gr)))
        # the graphs read and write these tensors' memory: keep them alive while the graphs are
        self._graphs = {"problem": prob, "modes": graphs, "static": (t, do, kept)}
        return graphs

    def gate_outputs(self, inp, prob, grads):
        graphs = self._capture(inp, prob, grads)
        got = {}
        for mode, (g, outs) in graphs.items():
            for x in outs.values():
                x.detach().fill_(float("nan"))  # a replay that computes nothing fails the gate
            g.replay()
            torch.cuda.synchronize()
            for name, x in outs.items():
                # fwd+bwd is the main result of o's gradients; the others are judged as name@mode
                main = (name == "o" and mode == "fwd") or (name != "o" and mode == "fwd+bwd")
                got[name if main else f"{name}@{mode}"] = self.to_bhsd(name, x.detach().clone(), prob)
        return got

    def callables(self, inp, prob):
        if self._graphs.get("problem") != prob:
            self._capture(inp, prob, grads=True)
        modes = self._graphs["modes"]
        return {m: g.replay for m, (g, _) in modes.items()}


class FlashSinkKVCache(System):
    """``flashsink.attention_kvcache`` (serving decode): q ``[B, 1, H, D]`` against the cache, contiguous
    ``[B, S_max, H_kv, D]`` (``flashsink-kvcache``) or paged (``flashsink-paged``: pages of the problem's
    page size in a random order, a block table ``[B, max_pages]``; the unused tail of each last page is
    NaN, so a kernel that reads past ``cache_seqlens`` fails the gate)."""

    name = "flashsink-kvcache"
    paged = False
    required_gate = "fast"  # the default precision
    note = "attention_kvcache, contiguous [B, S, H_kv, D] cache"

    def check_available(self, device):
        import flashsink

        if not hasattr(flashsink, "attention_kvcache"):
            raise Unavailable("flashsink.attention_kvcache is not in this build (the paged KV cache lands it)")

    def check_problem(self, prob, device, opts):
        if not prob.forward_only:
            raise Unavailable("n/a: attention_kvcache is the decode path (decode presets)")
        if self.paged and prob.page_size is None:
            raise Unavailable("n/a: no page size (the decode-paged preset)")

    def problem_note(self, prob):
        return f"{self.note}, page {prob.page_size}" if self.paged else self.note

    def prepare(self, inp, prob):
        t = dict(inp)
        t["q"] = inp["q"].transpose(1, 2).contiguous()  # [B, 1, H, D]
        b, n = prob.batch, prob.seq_kv
        t["cache_seqlens"] = torch.full((b,), n, dtype=torch.int32, device=inp["q"].device)
        t["block_table"] = None
        caches = {x: inp[x].transpose(1, 2).contiguous() for x in ("k", "v")}  # [B, N, H_kv, D]
        if self.paged:
            ps = prob.page_size
            per_seq = -(-n // ps)
            gen = torch.Generator(device="cpu").manual_seed(n)
            perm = torch.randperm(b * per_seq, generator=gen).to(inp["q"].device)
            t["block_table"] = perm.view(b, per_seq).to(torch.int32)
            for x, c in caches.items():
                flat = torch.full((b, per_seq * ps, *c.shape[2:]), float("nan"), dtype=c.dtype, device=c.device)
                flat[:, :n] = c
                pages = torch.empty_like(flat).view(b * per_seq, ps, *c.shape[2:])
                pages[perm] = flat.view(b * per_seq, ps, *c.shape[2:])  # page block_table[b, j] holds block j of b
                caches[x] = pages
        t.update(caches)
        return t

    def forward(self, t, prob):
        import flashsink

        return flashsink.attention_kvcache(t["q"], t["k"], t["v"], t["cache_seqlens"], block_table=t["block_table"],
                                           sinks=t["sinks"], window=prob.window, scale=prob.scale, layout="bshd")

    def to_bhsd(self, name, x, prob):
        return x.transpose(1, 2) if name == "o" else x


class FlashSinkPaged(FlashSinkKVCache):
    name = "flashsink-paged"
    paged = True
    note = "attention_kvcache, paged cache (random block table)"


class FlashSinkStrictGraph(FlashSinkGraph):
    name = "flashsink-strict-graph"
    precision = "strict"
    note = "flashsink-strict replayed from a CUDA graph"
