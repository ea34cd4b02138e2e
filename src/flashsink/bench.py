"""``flashsink bench``: flashsink against its peers, with a correctness gate before any timing.

For every problem (a preset, or ``--shape``) and every system:

1. **Gate.** The system runs forward and backward once on fresh inputs; its output (and, when a
   backward mode is asked for, dq / dk / dv / dsink) is judged against the float64 reference under
   both precision gates: :func:`flashsink.testing.check_precision` (gate 1 and gate 2, the precision
   standard: "strict") and :func:`flashsink.testing.check_fast` (the fast gate: "fast"). Each row
   says the strongest gate the system passes in its mode (strict, fast or none), and every system
   is timed, so speed and precision stand side by side; only a system that raises is not. flashsink
   must pass the gate of its own ``precision=`` (``flashsink``: fast, ``flashsink-strict``: strict),
   else its row says ``FAIL`` (timed all the same) and the command exits 1. SDPA has no sink: it is
   judged against the reference computed with ``sinks=None``.
2. **Timing** (METHOD.md): warm-up, then the median of many runs, through
   ``triton.testing.do_bench`` (CUDA events; it writes a 256 MB buffer between runs, so the L2
   never holds a previous iteration's data) or, without triton, CUDA events around each run with
   the same L2 flush. On ``--device cpu``: ``time.perf_counter``, median.
3. **Numbers.** TFLOP/s over the visible (q, k) pairs (exact count, bottom-right aligned), achieved
   GB/s over the fewest bytes the mode must move, the floor ``max(FLOPs / matmul ceiling,
   bytes / copy ceiling)`` with both ceilings measured at the start of the same run, % of floor,
   peak memory over the inputs, the speedup over the best peer that has sinks (fa4, flex, fla) and
   passes a gate, and the host time: the enqueue time of 20 calls without a sync, per call, after
   warm-up (fwd and fwd+bwd; fwd+bwd as a training step calls it, ``o = f(...); o.backward(do)``).

Problems are dense ``[B, H, S, D]`` (``seq_q < seq_kv`` bottom-right aligned), varlen (a packed
``[total, H, D]`` batch, :attr:`Problem.seqlens`; pairs and bytes summed over its sequences, the
reference run per sequence) or decode (``seq_q = 1`` against a KV cache, :attr:`Problem.forward_only`:
its other modes are n/a). Every system gets a row for every problem and mode; one that cannot run
says why.

``flashsink`` runs ``precision="fast"`` (the default), ``flashsink-strict`` ``precision="strict"``;
``flashsink-graph`` / ``flashsink-strict-graph`` are the same replayed from CUDA graphs (fwd, bwd,
fwd+bwd): the kernels' time without the host's, next to the eager rows; their gate judges replays.

The pieces are plain functions so the tests can check them on the CPU (pair count, FLOP and byte
formulas, the gate) and inject systems (:data:`SYSTEMS`).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import inspect
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass, field

import torch

from . import testing
from .testing import check_fast, check_precision, dtype_name

# ----------------------------------------------------------------------------------------------
# Problems


@dataclass(frozen=True)
class Problem:
    preset: str
    batch: int  # varlen: the number of sequences
    heads: int
    kv_heads: int
    seq_q: int  # varlen: the longest sequence (max_seqlen)
    seq_kv: int
    head_dim: int
    window: int | None
    dtype: str  # fp16 / bf16 / fp32
    causal: bool = True
    # varlen: the length of every packed sequence (q and k/v alike); None for [B, H, S, D] problems
    seqlens: tuple[int, ...] | None = None
    # decode: inference only, so the bwd / fwd+bwd modes are not applicable
    forward_only: bool = False
    # hf-train: a GptOssForCausalLM training step (bench_hf) over seq_q tokens, not one attention call
    hf_train: bool = False
    # decode-paged: the page size of the paged KV cache (flashsink.attention_kvcache with a block table)
    page_size: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return testing._resolve_dtype(self.dtype)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def kind(self) -> str:
        if self.hf_train:
            return "hf-train"
        return "varlen" if self.seqlens is not None else "decode" if self.forward_only else "dense"

    @property
    def tokens_q(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.batch * self.seq_q

    @property
    def tokens_kv(self) -> int:
        return sum(self.seqlens) if self.seqlens is not None else self.batch * self.seq_kv

    @property
    def n(self) -> int:
        """The table's N: total tokens (varlen), the length (seq_q == seq_kv), else the KV length."""
        if self.seqlens is not None:
            return self.tokens_q
        return self.seq_q if self.seq_q == self.seq_kv else self.seq_kv

    def label(self) -> str:
        w = "" if self.window is None else f" W={self.window}"
        c = "" if self.causal else " noncausal"
        if self.hf_train:
            return (f"{self.preset} GptOssForCausalLM train step T={self.seq_q} H={self.heads} Hkv={self.kv_heads} "
                    f"D={self.head_dim} layers sliding{w} / full {self.dtype}")
        if self.seqlens is not None:
            return (f"{self.preset} T={self.tokens_q} ({len(self.seqlens)} seqs, len {lengths_summary(self.seqlens)}) "
                    f"H={self.heads} Hkv={self.kv_heads} D={self.head_dim}{w}{c} {self.dtype}")
        n = f"N={self.seq_q}" if self.seq_q == self.seq_kv else f"Nq={self.seq_q},Nk={self.seq_kv}"
        page = "" if self.page_size is None else f" page={self.page_size}"
        return (f"{self.preset} B={self.batch} H={self.heads} Hkv={self.kv_heads} {n} "
                f"D={self.head_dim}{w}{c}{page} {self.dtype}")


# name -> (dtype, B, H, H_kv, D, W, sequence lengths). W may be a tuple: one problem per window.
PRESETS: dict[str, tuple] = {
    # The seed's golden problem.
    "golden": ("fp16", 1, 64, 8, 128, 128, (4096,)),
    # gpt-oss sliding-window layers (64 query heads, 8 KV heads, head dim 64, window 128).
    "gptoss-swa": ("bf16", 1, 64, 8, 64, 128, (4096,)),
    # gpt-oss full (causal) layers, swept over the context length.
    "gptoss-full": ("bf16", 1, 64, 8, 64, None, (2048, 4096, 8192, 16384)),
    # A Llama-style causal layer with head dim 128 (GQA 4), swept over the context length.
    "causal-d128": ("bf16", 1, 32, 8, 128, None, (1024, 2048, 4096, 8192, 16384)),
    # gpt-oss shapes on a packed batch: B = 64 sequences of random lengths (seed VARLEN_SEED)
    # summing to 32768 tokens, [total, H, D]; once with the window, once full causal.
    "varlen": ("bf16", 64, 64, 8, 64, (128, None), (32768,)),
    # Decode: one query per sequence (bottom-right causal: it sees the whole cache) against KV
    # caches of 4k, 16k, 64k; forward only, bound by the bytes of the cache.
    "decode": ("bf16", 8, 64, 8, 64, None, (4096, 16384, 65536)),
    # A Hugging Face GptOssForCausalLM training step (bench_hf): gpt-oss attention shapes, 2 layers
    # (sliding W, full), 16k tokens; attn_implementation flashsink vs flex_attention vs eager.
    "hf-train": ("bf16", 1, 64, 8, 64, 128, (16384,)),
    # decode against a paged KV cache (pages of PAGE_SIZE, a random block table) next to the contiguous
    # cache and the peers' contiguous decode
    "decode-paged": ("bf16", 8, 64, 8, 64, None, (4096, 16384, 65536)),
}
# --device cpu with --preset: the same kinds of problems, shrunk to a smoke run of a few seconds.
TINY_PRESETS: dict[str, tuple] = {
    "golden": ("fp16", 1, 4, 2, 32, 16, (128,)),
    "gptoss-swa": ("bf16", 1, 4, 2, 16, 16, (128,)),
    "gptoss-full": ("bf16", 1, 4, 2, 16, None, (32, 64)),
    "causal-d128": ("bf16", 1, 4, 2, 32, None, (32, 64)),
    "varlen": ("bf16", 6, 4, 2, 16, (8, None), (96,)),
    "decode": ("bf16", 2, 4, 2, 16, None, (64, 200)),
    "hf-train": ("bf16", 1, 4, 2, 16, 16, (96,)),
    "decode-paged": ("bf16", 2, 4, 2, 16, None, (64, 200)),
}
MODES = ("fwd", "bwd", "fwd+bwd")
VARLEN_PRESETS = ("varlen",)
DECODE_PRESETS = ("decode", "decode-paged")
PAGE_SIZE = {"decode-paged": 256}  # tiny presets: TINY_PAGE_SIZE
TINY_PAGE_SIZE = 16
HF_PRESETS = ("hf-train",)
VARLEN_SEED = 5  # fixed: every run packs the same lengths
FORWARD_ONLY = "n/a: decode is forward only (inference)"


def varlen_lengths(n_seqs: int, total: int, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """``n_seqs`` random lengths, each >= 1, summing to ``total``: the gaps between ``n_seqs - 1``
    distinct cut points drawn uniformly from ``[1, total)``. Python's ``random`` with a fixed seed,
    so every machine and torch version packs the same batch."""
    if not 1 <= n_seqs <= total:
        raise ValueError(f"need 1 <= n_seqs <= total, got n_seqs={n_seqs}, total={total}")
    cuts = sorted(random.Random(seed).sample(range(1, total), n_seqs - 1))
    edges = [0, *cuts, total]
    return tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


def lengths_summary(lengths) -> str:
    """``min/median/max`` of the sequence lengths."""
    return f"{min(lengths)}/{statistics.median(lengths):g}/{max(lengths)}"


def preset_problems(name: str, *, tiny: bool = False, dtype: str | None = None) -> list[Problem]:
    """The problems of a preset (``tiny``: its CPU smoke version; ``dtype`` overrides its dtype)."""
    dt, b, h, hk, d, w, seqs = (TINY_PRESETS if tiny else PRESETS)[name]
    dt = dtype or dt
    windows = w if isinstance(w, tuple) else (w,)
    if name in VARLEN_PRESETS:
        lens = varlen_lengths(b, seqs[0])
        return [Problem(name, b, h, hk, max(lens), max(lens), d, win, dt, seqlens=lens) for win in windows]
    if name in DECODE_PRESETS:
        page = (TINY_PAGE_SIZE if tiny else PAGE_SIZE[name]) if name in PAGE_SIZE else None
        return [Problem(name, b, h, hk, 1, n, d, win, dt, forward_only=True, page_size=page)
                for win in windows for n in seqs]
    if name in HF_PRESETS:
        return [Problem(name, b, h, hk, n, n, d, w, dt, hf_train=True) for n in seqs]
    return [Problem(name, b, h, hk, n, n, d, win, dt) for win in windows for n in seqs]


def parse_shape(text: str, dtype: str, *, causal: bool = True) -> Problem:
    """``B,H,HKV,N,D[,W]`` (N may be ``NQ:NK``) -> a custom problem."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (5, 6):
        raise ValueError(f"--shape wants B,H,HKV,N,D[,W], got {text!r}")
    try:
        b, h, hk = (int(x) for x in parts[:3])
        if ":" in parts[3]:
            sq, skv = (int(x) for x in parts[3].split(":"))
        else:
            sq = skv = int(parts[3])
        d = int(parts[4])
        w = None if len(parts) == 5 or parts[5].lower() == "none" else int(parts[5])
    except ValueError:
        raise ValueError(f"--shape wants integers B,H,HKV,N,D[,W], got {text!r}") from None
    if w is not None and w < 1:
        raise ValueError(f"--shape: the window W must be >= 1 (keys [i-W+1, i]) or 'none', got {w} in {text!r}")
    return Problem("custom", b, h, hk, sq, skv, d, w, dtype, causal)


# ----------------------------------------------------------------------------------------------
# Work: pairs, FLOPs, bytes


def visible_pairs(seq_q: int, seq_kv: int, window: int | None = None, causal: bool = True) -> int:
    """Exact number of visible (query, key) pairs of one head, bottom-right aligned: query row r
    has absolute position ``i = r + seq_kv - seq_q`` and sees keys ``[max(0, i-W+1), min(i, seq_kv-1)]``
    (causal) or all keys (not causal, no window)."""
    total = 0
    off = seq_kv - seq_q
    for r in range(seq_q):
        i = r + off
        hi = min(i, seq_kv - 1) if causal else seq_kv - 1
        lo = max(0, i - window + 1) if window is not None else 0
        total += max(0, hi - lo + 1)
    return total


# FLOPs per visible pair per head-dim element: fwd QK^T + PV = 2 matmuls (4); bwd recomputes
# QK^T and does dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q = 5 matmuls (10).
FLOP_FACTOR = {"fwd": 4, "bwd": 10, "fwd+bwd": 14}


def problem_pairs(prob: Problem) -> int:
    """Visible (q, k) pairs of one head over the whole batch: varlen sums its sequences (each one
    masked within itself); a dense problem is ``batch`` times one sequence."""
    if prob.seqlens is not None:
        return sum(visible_pairs(n, n, prob.window, prob.causal) for n in prob.seqlens)
    return prob.batch * visible_pairs(prob.seq_q, prob.seq_kv, prob.window, prob.causal)


def score_elems(prob: Problem) -> int:
    """Elements of the score matrices a dense reference materialises (per sequence for varlen)."""
    if prob.seqlens is not None:
        return prob.heads * sum(n * n for n in prob.seqlens)
    return prob.batch * prob.heads * prob.seq_q * prob.seq_kv


def flops(prob: Problem, mode: str) -> int:
    return FLOP_FACTOR[mode] * prob.heads * problem_pairs(prob) * prob.head_dim


def min_bytes(prob: Problem, mode: str) -> int:
    """Fewest bytes the mode must move through device memory: every input read once, every
    output written once. fwd: read q, k, v; write o. bwd: read q, k, v, do; write dq, dk, dv
    (the small lse / Delta rows, the sinks and cu_seqlens are left out). fwd+bwd: both, o written
    once. Decode (one query row per sequence) is almost all K/V-cache reads."""
    es = prob.torch_dtype.itemsize
    q = prob.heads * prob.tokens_q * prob.head_dim * es
    kv = prob.kv_heads * prob.tokens_kv * prob.head_dim * es
    fwd = q + 2 * kv + q  # q, k, v in; o out
    bwd = q + 2 * kv + q + q + 2 * kv  # q, k, v, do in; dq, dk, dv out
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": bwd + q}[mode]


def make_problem_inputs(prob: Problem, device, seed: int) -> dict:
    """Fresh random inputs of the problem (:func:`flashsink.testing.make_inputs`): [B, H, S, D]
    tensors, or for varlen packed [total, H, D] ones with ``cu_seqlens`` (int32, on ``device``) and
    ``max_seqlen``."""
    if prob.seqlens is None:
        return testing.make_inputs(prob.batch, prob.heads, prob.kv_heads, prob.seq_q, prob.seq_kv, prob.head_dim,
                                   prob.torch_dtype, device, seed=seed)
    t = prob.tokens_q
    inp = testing.make_inputs(1, prob.heads, prob.kv_heads, t, t, prob.head_dim, prob.torch_dtype, device,
                              layout="bshd", seed=seed)
    for n in ("q", "k", "v", "do"):
        inp[n] = inp[n][0]  # [total, H, D]
    inp["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(prob.seqlens)], dtype=torch.int32, device=device)
    inp["max_seqlen"] = max(prob.seqlens)
    return inp


# ----------------------------------------------------------------------------------------------
# Systems


class Unavailable(Exception):
    """The system cannot run here (or not this problem); the message says why."""


class System:
    name = "?"
    has_sink = True
    peer = False  # a peer with sinks: counts for "speedup over the best peer"
    note = ""
    required_gate: str | None = None  # flashsink: the gate of its precision= ("fast" / "strict"); peers: none

    def check_available(self, device: str) -> None:
        """Raise :class:`Unavailable` if the system cannot run on this machine."""

    def check_problem(self, prob: Problem, device: str, opts: dict) -> None:
        """Raise :class:`Unavailable` if the system cannot run this problem."""

    def problem_note(self, prob: Problem) -> str:
        return self.note

    def prepare(self, inp: dict, prob: Problem) -> dict:
        """Native-layout copies of the inputs (not timed)."""
        return dict(inp)

    def forward(self, t: dict, prob: Problem):
        """o in the native layout, differentiable in t's leaves."""
        raise NotImplementedError

    def leaves(self, t: dict) -> list[str]:
        return ["q", "k", "v", "sinks"] if self.has_sink else ["q", "k", "v"]

    def to_bhsd(self, name: str, x: torch.Tensor, prob: Problem) -> torch.Tensor:
        """A result (o, dq, dk, dv, dsink) back in the layout of the reference: [B, H, S, D], or
        packed [total, H, D] for varlen."""
        return x

    def gate_outputs(self, inp: dict, prob: Problem, grads: bool) -> dict:
        """Forward (+ backward) once on fresh leaves: o (and dq, dk, dv, dsink with ``grads``) in the
        reference's layout. An extra entry ``"name@tag"`` (another run of the same tensor) is
        judged against the reference's ``name`` too."""
        t = self.prepare(inp, prob)
        names = self.leaves(t)
        for n in names:
            t[n] = t[n].detach().clone().requires_grad_(grads)
        o = self.forward(t, prob)
        got = {"o": self.to_bhsd("o", o.detach(), prob)}
        if grads:
            gr = torch.autograd.grad(o, [t[n] for n in names], t["do"].to(o.dtype))
            for n, x in zip(names, gr):
                key = "dsink" if n == "sinks" else "d" + n
                got[key] = self.to_bhsd(key, x, prob)
        return got

    def callables(self, inp: dict, prob: Problem) -> dict:
        """fwd, bwd, fwd+bwd closures on native-layout inputs (layout conversion not timed)."""
        t = self.prepare(inp, prob)
        names = self.leaves(t)
        for n in names:
            t[n] = t[n].detach().clone().requires_grad_(True)
        leaves = [t[n] for n in names]

        def fwd():
            with torch.no_grad():
                return self.forward(t, prob)

        def fwd_bwd():
            o = self.forward(t, prob)
            return torch.autograd.grad(o, leaves, t["do"].to(o.dtype))

        def train_step():  # fwd+bwd as a training step calls it (zero_grad(set_to_none=True) first)
            for x in leaves:
                x.grad = None
            o = self.forward(t, prob)
            o.backward(t["do"].to(o.dtype))

        state = {}

        def bwd():
            if "o" not in state:  # forward once, outside the timed region; backward replays its graph
                state["o"] = self.forward(t, prob)
            return torch.autograd.grad(state["o"], leaves, t["do"].to(state["o"].dtype), retain_graph=True)

        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd, "host:fwd+bwd": train_step}

    def release(self) -> None:
        """Drop what the system keeps between its gate and its timing (called after each problem)."""


def _all_visible(prob: Problem) -> bool:
    """Every query row sees every key: no mask needed (decode: one row, bottom-right causal)."""
    return prob.seqlens is None and visible_pairs(prob.seq_q, prob.seq_kv, prob.window, prob.causal) == \
        prob.seq_q * prob.seq_kv


class FlashSink(System):
    """flashsink's eager calls, ``precision=self.precision``; it must pass that precision's gate."""

    name = "flashsink"
    precision = "fast"
    note = 'precision="fast" (the default)'

    @property
    def required_gate(self):
        return self.precision

    def forward(self, t, prob):
        import flashsink

        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            return flashsink.attention_varlen(t["q"], t["k"], t["v"], cu, cu, m, m, t["sinks"], window=prob.window,
                                              causal=prob.causal, scale=prob.scale, precision=self.precision)
        return flashsink.attention(t["q"], t["k"], t["v"], t["sinks"], window=prob.window,
                                   causal=prob.causal, scale=prob.scale, precision=self.precision)


class FlashSinkStrict(FlashSink):
    name = "flashsink-strict"
    precision = "strict"
    note = 'precision="strict"'


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

    def __init__(self):
        self._graphs: dict = {}

    def check_available(self, device):
        if device != "cuda":
            raise Unavailable("CUDA only (CUDA graphs)")

    def check_problem(self, prob, device, opts):
        if prob.seqlens is not None:
            raise Unavailable("n/a: attention_varlen checks cu_seqlens on the host (a device-to-host copy "
                              "each call), which a CUDA graph cannot capture")

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
                                           sinks=t["sinks"], window=prob.window, scale=prob.scale)

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


class Eager(System):
    name = "eager"
    note = "fp32 reference"

    def check_problem(self, prob, device, opts):
        # The reference materialises [B, H, Sq, Skv] float32 scores (per sequence for varlen);
        # forward+backward keeps about eight such tensors alive (scores, mask result, exp, P, and
        # their gradients).
        need = 8 * 4 * score_elems(prob)
        budget = opts.get("eager_max_gib", 48.0) * 2**30
        if need > budget:
            raise Unavailable(f"skipped: needs ~{need / 2**30:.0f} GiB of fp32 scores "
                              f"(> --eager-max-gib {budget / 2**30:g})")

    def forward(self, t, prob):
        from . import reference

        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            return reference.attention_varlen(t["q"], t["k"], t["v"], cu, cu, m, m, t["sinks"], window=prob.window,
                                              causal=prob.causal, scale=prob.scale)
        return reference.attention(t["q"], t["k"], t["v"], t["sinks"], window=prob.window,
                                   causal=prob.causal, scale=prob.scale)


class Sdpa(System):
    name = "sdpa"
    has_sink = False
    note = "no sink"

    def check_available(self, device):
        if device != "cuda":
            raise Unavailable("CUDA only in the bench")

    def check_problem(self, prob, device, opts):
        if prob.seqlens is not None:
            raise Unavailable("n/a: SDPA is not varlen (no cu_seqlens); padding to the longest sequence or "
                              "a block-diagonal mask over all tokens would time other work")

    def _dense(self, prob) -> bool:
        if _all_visible(prob):
            return False
        return prob.window is not None or (prob.causal and prob.seq_q != prob.seq_kv)

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return "no sink"
        if self._dense(prob):
            return "no sink; dense bool mask, K/V expanded: computes all Sq*Skv pairs"
        if prob.causal and _all_visible(prob) and prob.seq_q < prob.seq_kv:
            return "no sink; no mask (one query row sees the whole cache)"
        return "no sink"

    def prepare(self, inp, prob):
        t = dict(inp)
        t["is_causal"] = prob.causal and not _all_visible(prob)  # decided here: forward is timed
        g = prob.heads // prob.kv_heads
        if self._dense(prob):
            from .reference import visible_mask

            t["mask"] = visible_mask(prob.seq_q, prob.seq_kv, window=prob.window, causal=prob.causal,
                                     device=inp["q"].device)
            # A masked call with enable_gqa falls back to the math backend; expanded K/V keep the
            # memory-efficient kernel. The expansion is not timed.
            if g > 1:
                t["k"] = inp["k"].repeat_interleave(g, dim=1)
                t["v"] = inp["v"].repeat_interleave(g, dim=1)
        return t

    def forward(self, t, prob):
        import torch.nn.functional as F

        if "mask" in t:
            return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"], scale=prob.scale)
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=t["is_causal"],
                                              scale=prob.scale, enable_gqa=prob.heads != prob.kv_heads)

    def to_bhsd(self, name, x, prob):
        g = prob.heads // prob.kv_heads
        if name in ("dk", "dv") and x.shape[1] == prob.heads and g > 1:
            b, _, s, d = x.shape
            return x.view(b, prob.kv_heads, g, s, d).sum(2)
        return x


class Flex(System):
    """torch FlexAttention with the sink applied through its LSE.

    Without the sink, flex gives ``o0 = sum_j e^{s_j} v_j / Z`` and ``lse = log Z``. With it,
    ``o = sum_j e^{s_j} v_j / (Z + e^{sink}) = o0 * Z / (Z + e^{sink}) = o0 * sigmoid(lse - sink)``.
    Gradients reach the sink, and q / k through the lse, by autograd. Varlen runs as one packed
    sequence [1, H, total, D] with a document mask (same sequence, causal / window within it).
    """

    name = "flex"
    peer = True
    note = "o*sigmoid(lse-sink), torch.compile"

    def __init__(self, compile: bool = True):
        self.compile = compile
        self._fn = None

    def check_available(self, device):
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"torch.nn.attention.flex_attention not importable: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (flex has no CPU backward)")

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return self.note + "; document mask over the packed batch"
        return self.note

    def _build(self):
        from torch.nn.attention.flex_attention import flex_attention

        use_aux = "return_aux" in inspect.signature(flex_attention).parameters
        if use_aux:
            from torch.nn.attention.flex_attention import AuxRequest

        def flex_sink(q, k, v, sinks, block_mask, scale, gqa):
            if use_aux:
                o, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                        return_aux=AuxRequest(lse=True))
                lse = aux.lse
            else:
                o, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                        return_lse=True)
            factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
            return (o.float() * factor.unsqueeze(-1)).to(q.dtype)

        if not self.compile:
            return flex_sink
        # One graph per problem shape (dynamic=False: static shapes, as a tuned layer would run).
        # The bench runs a dozen shapes through this one function; past dynamo's recompile limit
        # (8) it would silently fall back to eager flex, so raise the limit.
        import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make torch local here)

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(256, getattr(dynamo.config, knob)))
        return torch.compile(flex_sink, dynamic=False)

    def prepare(self, inp, prob):
        from torch.nn.attention.flex_attention import create_block_mask

        w, causal = prob.window, prob.causal
        t = dict(inp)
        if prob.seqlens is not None:
            # packed [total, H, D] -> [1, H, total, D]; doc[i] = the sequence of token i
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(0, 1).unsqueeze(0).contiguous()
            dev = inp["q"].device
            doc = torch.repeat_interleave(torch.arange(len(prob.seqlens), device=dev),
                                          torch.tensor(prob.seqlens, device=dev))

            def doc_mask(b, h, q_idx, kv_idx):
                keep = doc[q_idx] == doc[kv_idx]  # q and k/v share the packing: positions line up
                if causal:
                    keep = keep & (kv_idx <= q_idx)
                if w is not None:
                    keep = keep & (q_idx - kv_idx < w)
                return keep

            total = prob.tokens_q
            t["block_mask"] = create_block_mask(doc_mask, None, None, total, total, device=dev)
            return t

        off = prob.seq_kv - prob.seq_q

        def mask_mod(b, h, q_idx, kv_idx):
            i = q_idx + off
            keep = (kv_idx <= i) if causal else (kv_idx >= 0)
            if w is not None:
                keep = keep & (i - kv_idx < w)
            return keep

        if _all_visible(prob):  # decode: nothing to mask
            t["block_mask"] = None
        else:
            t["block_mask"] = create_block_mask(mask_mod, None, None, prob.seq_q, prob.seq_kv,
                                                device=inp["q"].device)
        return t

    def forward(self, t, prob):
        if self._fn is None:
            self._fn = self._build()
        return self._fn(t["q"], t["k"], t["v"], t["sinks"], t["block_mask"], prob.scale,
                        prob.heads != prob.kv_heads)

    def to_bhsd(self, name, x, prob):
        if prob.seqlens is not None and name in ("o", "dq", "dk", "dv"):
            return x[0].transpose(0, 1)  # [1, H, total, D] -> [total, H, D]
        return x


class Fla(System):
    """flash-linear-attention's softmax attention (Triton, [B, T, H, D] layout, causal only):
    ``fla.ops.attn.parallel.parallel_attn(..., sink_bias=)`` for T_q = T_k, varlen through its
    ``cu_seqlens`` (the packed batch as B = 1); decode through
    ``fla.ops.attn.decoding.attn_decoding_one_step(..., sink_bias=)`` (forward only)."""

    name = "fla"
    peer = True
    note = "parallel_attn(sink_bias=), bshd"

    def check_available(self, device):
        try:
            importlib.import_module("fla.ops.attn.parallel")
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"`import fla.ops.attn.parallel` failed: {type(exc).__name__}: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (Triton)")

    @staticmethod
    def _params(module: str, fn: str) -> set[str] | None:
        try:
            return set(inspect.signature(getattr(importlib.import_module(module), fn)).parameters)
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def _is_decode(prob) -> bool:
        return prob.seqlens is None and prob.seq_q == 1 < prob.seq_kv

    def problem_note(self, prob):
        if self._is_decode(prob):
            return "attn_decoding_one_step(sink_bias=), forward only"
        if prob.seqlens is not None:
            return "parallel_attn(cu_seqlens=, sink_bias=), packed B=1"
        return self.note

    def check_problem(self, prob, device, opts):
        if not prob.causal:
            raise Unavailable("n/a: parallel_attn is causal only")
        if self._is_decode(prob):
            if opts.get("grads"):
                raise Unavailable("n/a: fla's decoding kernel is forward only (run --mode fwd)")
            params = self._params("fla.ops.attn.decoding", "attn_decoding_one_step")
            if params is None or "sink_bias" not in params:
                raise Unavailable("n/a: this fla has no fla.ops.attn.decoding.attn_decoding_one_step(sink_bias=)")
            if prob.window is not None and prob.window < prob.seq_kv:
                raise Unavailable("n/a: fla's decoding kernel has no window")
            return
        params = self._params("fla.ops.attn.parallel", "parallel_attn")
        if params is not None and "sink_bias" not in params:
            raise Unavailable("n/a: this fla's parallel_attn has no sink_bias")
        if prob.seqlens is not None:
            if params is not None and "cu_seqlens" not in params:
                raise Unavailable("n/a: this fla's parallel_attn has no cu_seqlens")
            return
        if prob.seq_q != prob.seq_kv:
            raise Unavailable("n/a: parallel_attn needs seq_q == seq_kv")

    def prepare(self, inp, prob):
        t = dict(inp)
        if prob.seqlens is not None:  # [total, H, D] -> [1, total, H, D]
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].unsqueeze(0)
            t["cu_seqlens"] = inp["cu_seqlens"].long()
        elif self._is_decode(prob):  # q [1, B, H, D]; the caches packed [1, B*N, H_kv, D]
            b, n = prob.batch, prob.seq_kv
            t["q"] = inp["q"].transpose(1, 2).reshape(1, b, prob.heads, prob.head_dim).contiguous()
            for x in ("k", "v"):
                t[x] = inp[x].transpose(1, 2).reshape(1, b * n, prob.kv_heads, inp[x].shape[-1]).contiguous()
            t["do"] = inp["do"].transpose(1, 2).reshape(1, b, prob.heads, -1).contiguous()
            t["cu_seqlens"] = torch.arange(0, (b + 1) * n, n, dtype=torch.long, device=inp["q"].device)
        else:
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(1, 2).contiguous()
        return t

    def forward(self, t, prob):
        if self._is_decode(prob):
            from fla.ops.attn.decoding import attn_decoding_one_step

            return attn_decoding_one_step(t["q"], t["k"], t["v"], scale=prob.scale, cu_seqlens=t["cu_seqlens"],
                                          sink_bias=t["sinks"])
        from fla.ops.attn.parallel import parallel_attn

        if prob.seqlens is not None:
            return parallel_attn(t["q"], t["k"], t["v"], scale=prob.scale, window_size=prob.window,
                                 cu_seqlens=t["cu_seqlens"], sink_bias=t["sinks"])
        return parallel_attn(t["q"], t["k"], t["v"], scale=prob.scale, window_size=prob.window,
                             sink_bias=t["sinks"])

    def to_bhsd(self, name, x, prob):
        if name not in ("o", "dq", "dk", "dv"):
            return x
        if prob.seqlens is not None:
            return x[0]  # [1, total, H, D] -> [total, H, D]
        if self._is_decode(prob):
            return x[0].unsqueeze(2)  # [1, B, H, D] -> [B, H, 1, D]
        return x.transpose(1, 2)


class Fa4(System):
    """FlashAttention-4 (``flash_attn.cute``, CuTe DSL; Hopper and Blackwell) with its learnable sink:
    ``flash_attn_func(q, k, v, softmax_scale=, causal=, window_size=(W - 1, 0), learnable_sink=)`` on
    [B, S, H, D] (its layout; decode is S_q = 1 against the cache, bottom-right aligned as ours), and
    ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, ...)``
    on the packed [total, H, D] batch. It returns (o, lse); o is judged. Every configuration compiles
    at its first call (5-15 s): the gate's, and each mode's first call, outside the timing."""

    name = "fa4"
    peer = True
    note = "flash_attn.cute flash_attn_func(learnable_sink=), bshd"
    MODULE = "flash_attn.cute.interface"

    def __init__(self):
        self._fns: dict = {}

    def _fn(self, name: str):
        if name not in self._fns:
            self._fns[name] = getattr(importlib.import_module(self.MODULE), name)
        return self._fns[name]

    def check_available(self, device):
        try:
            importlib.import_module(self.MODULE)
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"`import {self.MODULE}` failed: {type(exc).__name__}: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (CuTe DSL kernels)")

    def check_problem(self, prob, device, opts):
        if prob.dtype not in ("fp16", "bf16"):
            raise Unavailable(f"n/a: FA4 takes fp16 / bf16 inputs, not {prob.dtype}")
        if prob.seqlens is not None and not hasattr(importlib.import_module(self.MODULE), "flash_attn_varlen_func"):
            raise Unavailable(f"n/a: this {self.MODULE} has no flash_attn_varlen_func")

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return "flash_attn_varlen_func(cu_seqlens_q/k=, learnable_sink=), packed"
        return self.note

    def prepare(self, inp, prob):
        t = dict(inp)
        if prob.seqlens is None:  # [B, H, S, D] -> [B, S, H, D]
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(1, 2).contiguous()
        return t

    def forward(self, t, prob):
        kw = dict(softmax_scale=prob.scale, causal=prob.causal, learnable_sink=t["sinks"],
                  window_size=(None, None) if prob.window is None else (prob.window - 1, 0))
        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            out = self._fn("flash_attn_varlen_func")(t["q"], t["k"], t["v"], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=m, max_seqlen_k=m, **kw)
        else:
            out = self._fn("flash_attn_func")(t["q"], t["k"], t["v"], **kw)
        return out[0] if isinstance(out, (tuple, list)) else out  # (o, lse)

    def to_bhsd(self, name, x, prob):
        if prob.seqlens is None and name in ("o", "dq", "dk", "dv"):
            return x.transpose(1, 2)
        return x


# The registry, in table order. Tests may add entries (a deliberately wrong system).
SYSTEMS: dict[str, type] = {"flashsink": FlashSink, "flashsink-graph": FlashSinkGraph,
                            "flashsink-strict": FlashSinkStrict, "flashsink-strict-graph": FlashSinkStrictGraph,
                            "flashsink-kvcache": FlashSinkKVCache, "flashsink-paged": FlashSinkPaged,
                            "fa4": Fa4, "flex": Flex, "fla": Fla, "sdpa": Sdpa, "eager": Eager}
GATES = ("strict", "fast")  # strongest first: a row's "gate" is the first of these it passes, else "none"

# ----------------------------------------------------------------------------------------------
# Reference (chunked over query heads, so the largest presets fit)

_REF_SCORE_ELEMS = 2**28  # fp64 scores per chunk: 2 GiB per [.., Sq, Skv] tensor


def reference(inp: dict, prob: Problem, *, sinks: bool, compute_dtype) -> dict:
    """o, dq, dk, dv (and dsink) of the reference, in ``compute_dtype``. Chunks over query heads
    within each KV head (dk / dv summed over the chunks), so the score tensor of one chunk stays
    under 2**28 elements even at N = 16k. Varlen: one dense reference per sequence."""
    if prob.seqlens is not None:
        return _reference_varlen(inp, prob, sinks=sinks, compute_dtype=compute_dtype)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    s = inp["sinks"] if sinks else None
    g = prob.heads // prob.kv_heads
    kw = dict(window=prob.window, causal=prob.causal, scale=prob.scale, compute_dtype=compute_dtype)
    per_head = max(1, prob.batch * prob.seq_q * prob.seq_kv)
    if per_head * prob.heads <= _REF_SCORE_ELEMS:
        return testing.reference_grads(q, k, v, s, do, **kw)
    step = max(1, min(g, _REF_SCORE_ELEMS // per_head))
    out = {n: [] for n in ("o", "dq", "dsink")}
    dks, dvs = [], []
    for h in range(prob.kv_heads):
        dk = dv = None
        for j0 in range(0, g, step):
            a, b = h * g + j0, h * g + min(g, j0 + step)
            r = testing.reference_grads(q[:, a:b], k[:, h:h + 1], v[:, h:h + 1], None if s is None else s[a:b],
                                        do[:, a:b], **kw)
            out["o"].append(r["o"])
            out["dq"].append(r["dq"])
            if s is not None:
                out["dsink"].append(r["dsink"])
            dk = r["dk"] if dk is None else dk + r["dk"]
            dv = r["dv"] if dv is None else dv + r["dv"]
        dks.append(dk)
        dvs.append(dv)
    return {
        "o": torch.cat(out["o"], 1), "dq": torch.cat(out["dq"], 1),
        "dk": torch.cat(dks, 1), "dv": torch.cat(dvs, 1),
        "dsink": torch.cat(out["dsink"]) if s is not None else None,
    }


def _reference_varlen(inp: dict, prob: Problem, *, sinks: bool, compute_dtype) -> dict:
    """The varlen reference: :func:`reference` on every sequence as a [1, H, S_i, D] problem, the
    results packed back to [total, H, D] (dsink summed over the sequences)."""
    cu = inp["cu_seqlens"].tolist()
    parts = {n: [] for n in ("o", "dq", "dk", "dv")}
    dsink = None
    for i, n in enumerate(prob.seqlens):
        if n == 0:
            continue
        sub = dataclasses.replace(prob, batch=1, seq_q=n, seq_kv=n, seqlens=None)
        sub_inp = {x: inp[x][cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0) for x in ("q", "k", "v", "do")}
        sub_inp["sinks"] = inp["sinks"]
        r = reference(sub_inp, sub, sinks=sinks, compute_dtype=compute_dtype)
        for x in parts:
            parts[x].append(r[x][0].transpose(0, 1))  # [1, H, S_i, D] -> [S_i, H, D]
        if sinks:
            dsink = r["dsink"] if dsink is None else dsink + r["dsink"]
    return {**{x: torch.cat(v) for x, v in parts.items()}, "dsink": dsink}


# ----------------------------------------------------------------------------------------------
# Gate


def _mode_tensors(mode: str) -> tuple[str, ...]:
    return ("o",) if mode == "fwd" else ("o", "dq", "dk", "dv", "dsink")


@dataclass
class GateResult:
    fwd_ok: bool  # the strict gate (the precision standard)
    bwd_ok: bool
    reports: list = field(default_factory=list)  # PrecisionReport, strict gate
    error: str = ""
    fast_reports: list | None = None  # PrecisionReport, fast gate; None without lowp (--no-gate2)

    def _of(self, mode: str, gate_name: str) -> list:
        reports = self.reports if gate_name == "strict" else (self.fast_reports or [])
        return [r for r in reports if r.name.split("@")[0] in _mode_tensors(mode)]

    def passes(self, mode: str, gate_name: str) -> bool:
        """Every tensor of the mode passes ``gate_name``. Without the fast gate's reports (no lowp),
        "fast" falls back to strict: the only gate there is to judge by."""
        if self.error:
            return False
        if gate_name == "fast" and self.fast_reports is None:
            gate_name = "strict"
        reports = self._of(mode, gate_name)
        if mode != "fwd" and not any(r.name == "dq" for r in reports):
            return False  # no backward was judged
        return bool(reports) and all(r.passed for r in reports)

    def label(self, mode: str) -> str:
        """The strongest gate passed in this mode: "strict", "fast" or "none"."""
        for name in GATES:
            if (name == "strict" or self.fast_reports is not None) and self.passes(mode, name):
                return name
        return "none"

    def failing(self, mode: str, gate_name: str) -> list[str]:
        """Names of the tensors of the mode that fail ``gate_name``."""
        return [r.name for r in self._of(mode, gate_name) if not r.passed]

    def reason(self, mode: str, gate_name: str = "strict") -> str:
        if self.error:
            return self.error
        bad = [f"{r.name}: {r.reason or 'failed'}" for r in self._of(mode, gate_name) if not r.passed]
        return "; ".join(bad)


def gate(system: System, prob: Problem, inp: dict, expected: dict, lowp: dict | None, *, grads: bool) -> GateResult:
    """Run the system forward (+ backward) once and judge it under the precision standard (strict)
    and, when ``lowp`` is given, the fast gate."""
    dt = prob.torch_dtype
    try:
        got = system.gate_outputs(inp, prob, grads)
    except Exception as exc:  # noqa: BLE001 -- a crash is a failed gate, reported like one
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return GateResult(False, False, [], error=msg[:300])
    check = ["o"] + (["dq", "dk", "dv"] + (["dsink"] if system.has_sink else []) if grads else [])
    # other runs of the same tensors ("o@fwd+bwd"): judged against the same reference
    names = check + [n for n in got if "@" in n and n.split("@")[0] in check]

    def judge(fn):
        return [fn(n, got.get(n), expected[n.split("@")[0]], dt,
                   lowp=None if lowp is None else lowp[n.split("@")[0]]) for n in names]

    reports = judge(check_precision)
    fast = None if lowp is None else judge(check_fast)
    fwd_ok = all(r.passed for r in reports if r.name.split("@")[0] == "o")
    bwd_ok = grads and all(r.passed for r in reports)
    return GateResult(fwd_ok, bwd_ok, reports, fast_reports=fast)


# ----------------------------------------------------------------------------------------------
# Timing


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Median time of ``fn`` in ms. CUDA: triton.testing.do_bench when importable, else CUDA
    events; both flush the L2 between runs (a 256 MB write), so a small windowed problem whose
    inputs fit in the 50-60 MB L2 is not timed from a warm cache -- a real layer reads its q, k, v
    from HBM. CPU: time.perf_counter."""

    def __init__(self, device: str, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 10):
        self.device, self.warmup_ms, self.rep_ms, self.min_reps = device, warmup_ms, rep_ms, min_reps
        self.method = "perf_counter median"
        self._do_bench = None
        if device == "cuda":
            try:
                from triton.testing import do_bench

                self._do_bench = do_bench
                self.method = "triton.testing.do_bench median (L2 flushed between runs)"
            except Exception:  # noqa: BLE001
                self.method = "CUDA events median (L2 flushed between runs)"

    def __call__(self, fn) -> float:
        if self.device != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            est = max(time.perf_counter() - start, 1e-6) * 1e3
            n = max(self.min_reps, min(1000, int(self.rep_ms / est)))
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        if self._do_bench is not None:
            # do_bench repeats for rep_ms; a slow call (tens of ms at N = 16k) would get one or two
            # runs, so stretch rep_ms to at least min_reps calls (capped at ~3 s per row).
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            est = s.elapsed_time(e)
            rep = min(max(self.rep_ms, self.min_reps * est), max(self.rep_ms, 3000.0))
            return float(self._do_bench(fn, warmup=self.warmup_ms, rep=rep, return_mode="median"))
        return self._events(fn)

    def _events(self, fn) -> float:
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            flush.zero_()
            fn()
        e.record()
        torch.cuda.synchronize()
        est = max(s.elapsed_time(e) / 5, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        n = max(self.min_reps, min(int(self.rep_ms / est), 10000))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            flush.zero_()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)


def measure_ceilings(device: str, timer: Timer) -> dict:
    """The two ceilings of the floor, measured now: a matmul rate and a device copy rate."""
    if device == "cuda":
        n, dt = 8192, torch.bfloat16
        copy_bytes = 2**30
    else:
        n, dt = 512, torch.float32
        copy_bytes = 2**24
    gen = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)  # random, never zeros
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)
    ms_mm = timer(lambda: torch.matmul(a, b))
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    ms_cp = timer(lambda: dst.copy_(src))
    del a, b, src, dst
    return {
        "matmul_tflops": 2 * n**3 / (ms_mm * 1e-3) / 1e12,
        "matmul": f"{dtype_name(dt)} {n}x{n}x{n} torch.matmul",
        "copy_gbs": 2 * copy_bytes / (ms_cp * 1e-3) / 1e9,  # read + write
        "copy": f"device copy of {copy_bytes / 2**30:g} GiB (read+write counted)",
    }


# ----------------------------------------------------------------------------------------------
# The run


def _commit() -> str:
    env = os.environ.get("FLASHSINK_COMMIT")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip()[:12] + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return "unknown (no .git; set FLASHSINK_COMMIT)"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except Exception:  # noqa: BLE001
        mod = sys.modules.get(pkg)
        return getattr(mod, "__version__", "not installed")


def header(device: str) -> dict:
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run; not a performance number)"
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "tilelang": _version("tilelang"),
        "fla": _version("fla-core"),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _peak_mib(fn, device) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


HOST_CALLS = 20  # calls enqueued back to back for the host time
HOST_MODES = ("fwd", "fwd+bwd")


def host_us(fn, device: str, calls: int = HOST_CALLS) -> float:
    """Host time per call in us: ``calls`` calls enqueued without a sync (the device may still be
    running them), divided by ``calls``. Run after warm-up: first-call compiles stay out."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / calls * 1e6


def _callables(system: System, prob: Problem, inp: dict):
    """fwd, bwd, fwd+bwd closures (:meth:`System.callables`) and a state slot for the caller."""
    return system.callables(inp, prob), None


def run_bench(problems: list[Problem], *, systems: list[str], modes: list[str], device: str,
              timer: Timer | None = None, opts: dict | None = None, profile: bool = False,
              gate2: bool = True, seed: int = 0, result: dict | None = None,
              on_problem=None) -> dict:
    """Gate, then time, every (problem, system, mode). Returns the JSON-ready result; pass
    ``result`` (a dict, filled in place) to keep the rows done so far if the run is cut short.
    ``on_problem(result)`` is called after each problem."""
    opts = dict(opts or {})
    timer = timer or Timer(device)
    result = {} if result is None else result
    result.update({"header": header(device), "timing": timer.method, "rows": [], "profiles": [], "gates": []})
    _say(f"bench on {result['header']['device']}; measuring the ceilings ...")
    ceil = measure_ceilings(device, timer)
    result["ceilings"] = ceil
    _say(f"  matmul {ceil['matmul_tflops']:.4g} TFLOP/s ({ceil['matmul']}), copy {ceil['copy_gbs']:.4g} GB/s")

    sys_objs = {}
    for name in systems:
        obj = SYSTEMS[name]()
        try:
            obj.check_available(device)
            sys_objs[name] = (obj, "")
        except Unavailable as exc:
            sys_objs[name] = (obj, f"unavailable: {exc}")

    for prob in problems:
        tag = f"[{prob.label()}]"
        if prob.hf_train:  # a model's training step, not one attention call: its own runner
            from . import bench_hf

            rows, gates = bench_hf.run_problem(prob, systems, device, timer, seed, tiny=prob.seq_q < 1024, say=_say,
                                               timed="fwd+bwd" in modes)
            result["rows"].extend(rows)
            result["gates"].extend(gates)
            if on_problem is not None:
                on_problem(result)
            continue
        # decode is forward only: no backward in its gate, and its other modes are n/a
        grads = any(m != "fwd" for m in modes) and not prob.forward_only
        if prob.seqlens is not None:
            _say(f"{tag} {len(prob.seqlens)} sequences (seed {VARLEN_SEED}), lengths min/median/max "
                 f"{lengths_summary(prob.seqlens)}, {prob.tokens_q} tokens")
        inp = make_problem_inputs(prob, device, seed)
        refs = {}

        def ref(sinks: bool):
            if sinks not in refs:
                what = "with sinks" if sinks else "without sinks (for sdpa)"
                _say(f"{tag} reference fp64 {what} ...")
                exp = reference(inp, prob, sinks=sinks, compute_dtype=torch.float64)
                low = None
                if gate2 and prob.torch_dtype != torch.float64:
                    _say(f"{tag} reference {prob.dtype} {what} (gate 2) ...")
                    low = reference(inp, prob, sinks=sinks, compute_dtype=prob.torch_dtype)
                refs[sinks] = (exp, low)
            return refs[sinks]

        prob_rows = []
        for name in systems:
            system, unavailable = sys_objs[name]
            note = system.problem_note(prob)
            status = unavailable
            if not status:
                try:
                    system.check_problem(prob, device, dict(opts, grads=grads))
                except Unavailable as exc:
                    status = str(exc) if str(exc).startswith(("n/a", "skipped")) else f"n/a: {exc}"
            g = None
            if not status:
                exp, low = ref(system.has_sink)
                _say(f"{tag} {name}: correctness gate (first call compiles) ...")
                t0 = time.perf_counter()
                g = gate(system, prob, inp, exp, low, grads=grads)
                labels = {m: g.label(m) for m in modes if not (prob.forward_only and m != "fwd")}
                _say(f"{tag} {name}: gate {'raised' if g.error else labels} in {time.perf_counter() - t0:.1f} s")

                def dump(reports):
                    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(r).items()}
                            for r in reports]

                result["gates"].append({
                    "problem": asdict(prob), "system": name, "error": g.error, "reports": dump(g.reports),
                    "fast_reports": None if g.fast_reports is None else dump(g.fast_reports),
                })
            calls = None
            for mode in modes:
                row = {
                    "preset": prob.preset, "problem": prob.label(), "N": prob.n, "mode": mode, "system": name,
                    "kind": prob.kind, "window": prob.window,
                    "note": note, "status": "", "gate": None, "gate_fails": "", "ms": None, "host_us": None, "tflops": None,
                    "gbs": None, "floor_ms": None, "pct_floor": None, "peak_mib": None, "speedup": None,
                    "flops": flops(prob, mode), "bytes": min_bytes(prob, mode),
                }
                fl_ms = max(row["flops"] / (ceil["matmul_tflops"] * 1e12), row["bytes"] / (ceil["copy_gbs"] * 1e9)) * 1e3
                row["floor_ms"] = fl_ms
                row["bound"] = "flops" if row["flops"] / ceil["matmul_tflops"] / 1e3 >= row["bytes"] / ceil["copy_gbs"] else "bytes"
                if prob.forward_only and mode != "fwd":
                    row["status"] = FORWARD_ONLY
                elif status:
                    row["status"] = status
                elif g.error:
                    row["status"] = "FAIL: " + g.error
                else:
                    # timed whatever gate it passes: the row says which, so speed and precision stand
                    # side by side; flashsink must pass its own precision's gate
                    row["gate"] = g.label(mode)
                    stronger = GATES[:GATES.index(row["gate"])] if row["gate"] in GATES else GATES
                    row["gate_fails"] = "; ".join(f"{x}: {', '.join(g.failing(mode, x))}" for x in stronger
                                                  if g.failing(mode, x))
                    need = system.required_gate
                    if need is None or g.passes(mode, need):
                        verdict = "ok"
                    elif g.fast_reports is None:  # --no-gate2: no lowp, so no fast gate; judged by gate 1
                        verdict = f"FAIL ({need} gate not run without gate 2; strict): " + g.reason(mode)
                    else:
                        verdict = f"FAIL ({need} gate): " + g.reason(mode, need)
                    if calls is None:
                        calls, state = _callables(system, prob, inp)
                    _say(f"{tag} {name} {mode}: timing ...")
                    try:
                        calls[mode]()  # first call of this mode: any compile (flex no-grad graph) stays out
                        _sync(device)
                        row["peak_mib"] = _peak_mib(calls[mode], device)
                        ms = timer(calls[mode])
                        if mode in HOST_MODES:
                            host = calls.get("host:" + mode, calls[mode])
                            host()  # its own first call (the train step's .backward)
                            row["host_us"] = host_us(host, device)
                    except Exception as exc:  # noqa: BLE001
                        row["status"] = f"error while timing: {type(exc).__name__}: {str(exc)[:200]}"
                    else:
                        row["status"] = verdict
                        row["ms"] = ms
                        row["tflops"] = row["flops"] / (ms * 1e-3) / 1e12
                        row["gbs"] = row["bytes"] / (ms * 1e-3) / 1e9
                        row["pct_floor"] = 100.0 * fl_ms / ms
                prob_rows.append(row)
            calls = state = None
            system.release()
            if profile and name == "flashsink" and device == "cuda" and g is not None and not g.error:
                _say(f"{tag} flashsink: profiling one fwd+bwd ...")
                result["profiles"].append({"problem": prob.label(), "kernels": profile_flashsink(prob, inp)})
        # speedup over the best peer with sinks that passes a gate, per mode
        for mode in modes:
            peers = [r["ms"] for r in prob_rows if r["mode"] == mode and r["ms"] is not None
                     and SYSTEMS[r["system"]].peer and r["gate"] in GATES]
            best = min(peers) if peers else None
            for r in prob_rows:
                if r["mode"] == mode and r["ms"] is not None and best is not None:
                    r["speedup"] = best / r["ms"]
            result.setdefault("best_peer_ms", {})[f"{prob.label()} {mode}"] = best
        result["rows"].extend(prob_rows)
        if on_problem is not None:
            on_problem(result)
        del inp, refs
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------------------------------------
# Profile


_KERNEL_ROLES = (
    ("flashsink_fwd", "forward"),
    ("flashsink_bwd_preprocess", "preprocess (Delta, dsink)"),
    ("flashsink_bwd_postprocess", "postprocess (dQ cast)"),
    ("flashsink_bwd_dq", "dQ pass (deterministic)"),
    ("flashsink_bwd", "main backward"),
)


def kernel_role(name: str) -> str:
    for key, role in _KERNEL_ROLES:
        if key in name:
            return role
    low = name.lower()
    if "fill" in low or "zero" in low:
        return "torch fill (zeros)"
    if "copy" in low or "cast" in low or "elementwise" in low:
        return "torch copy / cast"
    return "other"


def profile_flashsink(prob: Problem, inp: dict, iters: int = 5) -> list[dict]:
    """Per-kernel device time of flashsink's fwd+bwd (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    calls, _ = _callables(FlashSink(), prob, inp)
    calls["fwd+bwd"]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            calls["fwd+bwd"]()
        torch.cuda.synchronize()
    rows = {}
    events = list(prof.key_averages())

    def dev_us(evt):
        us = getattr(evt, "self_device_time_total", None)
        return getattr(evt, "self_cuda_time_total", 0.0) if us is None else us

    kernels = [e for e in events if str(getattr(e, "device_type", "")).split(".")[-1] == "CUDA"]
    if not kernels:  # older profilers: keep device-timed events that are not CPU-side aten ops
        kernels = [e for e in events if dev_us(e) > 0 and not e.key.startswith(("aten::", "cuda"))]
    for evt in kernels:
        us = dev_us(evt)
        if us <= 0:
            continue
        rows[evt.key] = {"kernel": evt.key, "role": kernel_role(evt.key),
                         "calls_per_iter": evt.count / iters, "us_per_iter": us / iters}
    out = sorted(rows.values(), key=lambda r: -r["us_per_iter"])
    total = sum(r["us_per_iter"] for r in out) or 1.0
    for r in out:
        r["share"] = 100.0 * r["us_per_iter"] / total
    return out


# ----------------------------------------------------------------------------------------------
# Output


def _f(x, fmt):
    if x is None:
        return "-"
    if fmt.endswith("f") and 0 < abs(x) < 10 and fmt != ".4f":
        return format(x, ".3g")  # CPU smoke runs: small numbers keep their digits
    return format(x, fmt)


def format_table(result: dict) -> str:
    h, c = result["header"], result["ceilings"]
    lines = [
        f"device: {h['device']} | torch {h['torch']} | triton {h['triton']} | tilelang {h['tilelang']} | "
        f"fla {h['fla']} | commit {h['commit']} | {h['date']}",
        f"ceilings (measured in this run): matmul {c['matmul_tflops']:.4g} TFLOP/s ({c['matmul']}); "
        f"copy {c['copy_gbs']:.4g} GB/s ({c['copy']})",
        f"timing: {result['timing']}",
        "",
    ]
    if result.get("interrupted"):
        lines.insert(3, "INTERRUPTED (SIGTERM / Ctrl-C): only the problems finished before it are below")
    cols = [("preset", 12, "<"), ("N", 6, ">"), ("mode", 7, "<"), ("system", 22, "<"), ("gate", 6, "<"),
            ("ms", 9, ">"), ("host us", 8, ">"), ("TFLOP/s", 8, ">"), ("GB/s", 7, ">"), ("floor ms", 9, ">"),
            ("bound", 5, "<"), ("%floor", 6, ">"), ("peak MiB", 9, ">"), ("vs peer", 7, ">")]
    lines.append("  ".join(f"{t:{a}{w}}" for t, w, a in cols) + "  status / note")
    lines.append("-" * (sum(w for _, w, _ in cols) + 2 * len(cols) + 14))
    last, shown = None, set()
    rows = [r for r in result["rows"] if r["status"] != FORWARD_ONLY]  # said once, in the problem's heading
    for r in rows:
        if r["problem"] != last:
            if last is not None:
                lines.append("")
            fwd_only = any(x["problem"] == r["problem"] and x["status"] == FORWARD_ONLY for x in result["rows"])
            lines.append(f"# {r['problem']}" + ("   [forward only: bwd, fwd+bwd n/a]" if fwd_only else ""))
        last = r["problem"]
        untimed = r["ms"] is None and not r["status"].startswith("FAIL")
        if untimed:  # unavailable / n/a / skipped: one row for the modes that share the status
            key = (r["problem"], r["system"], r["status"])
            if key in shown:
                continue
            shown.add(key)
            same = [x["mode"] for x in rows if (x["problem"], x["system"], x["status"]) == key]
            every = {x["mode"] for x in rows if x["problem"] == r["problem"]}
            r = dict(r, mode="all" if len(same) > 1 and set(same) == every else ",".join(same),
                     floor_ms=None, bound="")
        vals = (r["preset"], str(r["N"]), r["mode"], r["system"], r.get("gate") or "-", _f(r["ms"], ".4f"),
                _f(r.get("host_us"), ".1f"), _f(r["tflops"], ".1f"), _f(r["gbs"], ".0f"), _f(r["floor_ms"], ".4f"),
                r["bound"], _f(r["pct_floor"], ".1f"), _f(r["peak_mib"], ".0f"),
                "-" if r["speedup"] is None else f"{r['speedup']:.2f}x")
        status = r["status"]
        if r.get("tokens_s"):
            status += f", {r['tokens_s']:,.0f} tokens/s"
        if r.get("gate_fails"):
            status += f" (fails {r['gate_fails']})"
        default_note = getattr(SYSTEMS.get(r["system"]), "note", "")
        if r["note"] and r["note"] != default_note:  # default notes are in the legend below
            status += f" ({r['note']})"
        lines.append("  ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, cols)) + "  " + status)
    lines += [
        "",
        "TFLOP/s over visible (q,k) pairs: fwd 4*pairs*D, bwd 10*pairs*D, fwd+bwd 14*pairs*D. GB/s over the "
        "fewest bytes (q,k,v[,do] read once; o[,dq,dk,dv] written once). floor = max(FLOPs/matmul ceiling, "
        "bytes/copy ceiling); %floor = floor/ms. peak MiB: max allocated over the inputs during one call. "
        "vs peer: best peer with sinks (fa4, flex, fla) passing a gate, ms / this ms (>1 = faster). gate: the "
        "strongest precision gate passed in this mode (strict: the precision standard; fast: rel L2 <= 1.5x "
        "torch's in the input dtype; none), every system is timed whatever it passes; flashsink must pass its "
        "own precision's gate, else FAIL. host us: enqueue time per call, 20 calls without a sync after "
        "warm-up (fwd+bwd: o = f(...); o.backward(do)). sdpa has no sink (judged against the no-sink reference).",
        *(["varlen: N = total tokens; pairs and bytes summed over the packed sequences (each masked within "
           "itself); the gate runs the reference per sequence."] if any(r.get("kind") == "varlen" for r in rows)
          else []),
        *(["decode: N = KV-cache length, one query row per sequence; bound by bytes, so %floor is the share of "
           "the copy ceiling reached (GB/s over the copy GB/s)."] if any(r.get("kind") == "decode" for r in rows)
          else []),
        *(["hf-train: N = tokens of one GptOssForCausalLM training step (zero_grad, loss, backward); ms per step, "
           "peak MiB = torch.cuda.max_memory_allocated over the step (weights and gradients included), vs peer = "
           "hf/flex_attention ms / this ms; gate judges the logits on a short sequence (fp64 model as expected, "
           "eager in the bench dtype as lowp)."] if any(r.get("kind") == "hf-train" for r in rows) else []),
    ]
    legend = [f"{n} = {getattr(SYSTEMS[n], 'note', '') or n}"
              for n in dict.fromkeys(r["system"] for r in result["rows"]) if n in SYSTEMS]
    if legend:
        lines.append("systems: " + "; ".join(legend))
    for p in result["profiles"]:
        lines += ["", f"profile: flashsink fwd+bwd, {p['problem']} (per iteration, torch.profiler CUDA)",
                  f"{'kernel':<60} {'role':<28} {'calls':>5} {'us':>9} {'share':>6}"]
        for k in p["kernels"]:
            lines.append(f"{k['kernel'][:60]:<60} {k['role']:<28} {k['calls_per_iter']:5.1f} "
                         f"{k['us_per_iter']:9.1f} {k['share']:5.1f}%")
    lines += ["", summary(result)]
    return "\n".join(lines)


def summary(result: dict) -> str:
    """One line per (problem, mode): flashsink (fast) against the best peer with sinks that passes a
    gate (its gate in brackets), FA4 and FLA (the peers the varlen and causal targets name) and SDPA; "strict ms" is flashsink-strict, "graph ms" flashsink
    replayed from a CUDA graph (its kernels without the host's time), "host us" flashsink's host time."""
    rows = [r for r in result["rows"] if r["status"] != FORWARD_ONLY]
    keys = list(dict.fromkeys((r["problem"], r["mode"]) for r in rows))
    wp = max([len("problem")] + [len(p) for p, _ in keys])
    out = [f"summary: {'problem':<{wp}} {'mode':<7} {'flashsink ms':>12} {'TFLOP/s':>8} {'GB/s':>6} {'%floor':>6}  "
           f"{'best peer':<25} {'vs peer':>7}  {'fa4 ms':>9}  {'fla ms':>9}  {'sdpa(no sink) ms':>16}  "
           f"{'strict ms':>9}  {'graph ms':>9}  {'host us':>7}"]
    for prob, mode in keys:
        rs = {r["system"]: r for r in rows if r["problem"] == prob and r["mode"] == mode}
        fs = rs.get("flashsink") or rs.get("hf/flashsink", {})  # hf-train: the model step, against flex
        peers = [r for r in rs.values() if r["ms"] is not None and r.get("gate") in GATES
                 and (getattr(SYSTEMS.get(r["system"]), "peer", False) or r["system"] == "hf/flex_attention")]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        fs_ms = fs.get("ms")
        fs_txt = _f(fs_ms, ".4f") if fs_ms is not None else (fs.get("status", "-")[:12] or "-")
        peer_txt = f"{best['system']} {best['ms']:.4f} [{best['gate']}]" if best else "none timed"
        out.append(
            f"         {prob:<{wp}} {mode:<7} {fs_txt:>12} {_f(fs.get('tflops'), '.1f'):>8} "
            f"{_f(fs.get('gbs'), '.0f'):>6} {_f(fs.get('pct_floor'), '.1f'):>6}  "
            f"{peer_txt:<25} "
            f"{'-' if fs.get('speedup') is None else format(fs['speedup'], '.2f') + 'x':>7}  "
            f"{_f(rs.get('fa4', {}).get('ms'), '.4f'):>9}  {_f(rs.get('fla', {}).get('ms'), '.4f'):>9}  "
            f"{_f(rs.get('sdpa', {}).get('ms'), '.4f'):>16}  {_f(rs.get('flashsink-strict', {}).get('ms'), '.4f'):>9}  "
            f"{_f(rs.get('flashsink-graph', {}).get('ms'), '.4f'):>9}  {_f(fs.get('host_us'), '.1f'):>7}"
        )
    return "\n".join(out)


def plot_title(result: dict) -> str:
    """The PNG's title: device, commit, date of one run, or of each run of a merged result
    (tools/bench_merge.py: ``{"runs": [{"header": ...}, ...], "rows": ...}``)."""
    headers = [result["header"]] if "header" in result else [r["header"] for r in result.get("runs", [])]
    devices = sorted({h["device"] for h in headers})
    commits = sorted({str(h["commit"])[:12] for h in headers})
    dates = sorted(h["date"] for h in headers)
    when = dates[0] if len(dates) < 2 or dates[0] == dates[-1] else f"{dates[0]} .. {dates[-1]}"
    return f"flashsink bench - {', '.join(devices)} - {', '.join(commits)} - {when}"


def plot(result: dict, path: str) -> str | None:
    """PNG: per preset and mode, TFLOP/s vs N (sweeps) or bars (single length). None if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"--plot: matplotlib is not importable ({exc}); no plot written"
    rows = [r for r in result["rows"] if r["tflops"] is not None]
    presets = list(dict.fromkeys(r["preset"] for r in result["rows"]))
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    systems = list(dict.fromkeys(r["system"] for r in result["rows"]))
    fig, axes = plt.subplots(len(presets), len(modes), figsize=(5 * len(modes), 3.6 * len(presets)), squeeze=False)
    for i, pr in enumerate(presets):
        pr_rows = [r for r in result["rows"] if r["preset"] == pr]
        # decode is bound by bytes: GB/s says more than TFLOP/s there
        key, unit = ("gbs", "GB/s") if any(r.get("kind") == "decode" for r in pr_rows) else \
            ("tflops", "TFLOP/s (visible pairs)")
        ns = sorted({r["N"] for r in pr_rows})
        variants = len({r["problem"] for r in pr_rows}) > len(ns)  # e.g. varlen: window 128 and full causal
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            sel = [r for r in rows if r["preset"] == pr and r["mode"] == mode]
            if not sel:
                fwd_only = any(r["mode"] == mode and r["status"] == FORWARD_ONLY for r in pr_rows)
                ax.text(0.5, 0.5, FORWARD_ONLY if fwd_only else "nothing timed (n/a, unavailable or FAIL)",
                        ha="center", va="center", transform=ax.transAxes, fontsize=8)
            elif len(ns) > 1:
                for s in systems:
                    pts = sorted((r["N"], r[key]) for r in sel if r["system"] == s)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("KV-cache length" if key == "gbs" else "N")
                ax.legend(fontsize=8)
            else:
                def tag(r):
                    if not variants:
                        return r["system"]
                    return f"{r['system']}\n{'full' if r.get('window') is None else 'W=' + str(r['window'])}"

                names = [tag(r) for r in sel]
                vals = [r[key] for r in sel]
                ax.bar(range(len(names)), vals, color=[f"C{systems.index(r['system'])}" for r in sel])
                ax.set_xticks(range(len(names)), names, fontsize=7 if variants else None)
                for x, v in enumerate(vals):
                    ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{pr} {mode}")
            ax.set_ylabel(unit)
    fig.suptitle(plot_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------
# Command


NO_CUDA_MESSAGE = (
    "error: flashsink bench needs a CUDA GPU (torch.cuda.is_available() is False here). "
    "Run it on a GPU machine, or pass --device cpu for a tiny smoke run of the CPU paths "
    "(reference and flashsink's PyTorch fallback; not a performance number)."
)
CPU_DEFAULT_SHAPE = "1,4,2,128,32,32"


def _precompile(problems: list[Problem], device: str) -> None:
    """Build flashsink's kernels for these problems in parallel processes (TileLang's disk cache),
    so the in-process first calls load rather than compile them one after another."""
    from ._validate import validate_attention
    from .ops.interface import kernel_config
    from .ops.precompile import precompile

    cfgs = []
    for p in problems:
        if p.seqlens is not None or p.hf_train:
            continue  # the varlen kernels (and the model's) compile in-process on their first call (the gate)
        inp = testing.make_inputs(p.batch, p.heads, p.kv_heads, 1, 1, p.head_dim, p.torch_dtype, "cpu", seed=0)
        spec = validate_attention(inp["q"], inp["k"], inp["v"], inp["sinks"], window=p.window, causal=p.causal,
                                  scale=None, layout="bhsd")
        try:
            cfgs.append(kernel_config(spec, torch.device(device), False))
        except NotImplementedError:
            pass  # the gate reports it
    if cfgs:
        precompile(cfgs)


def _parse_seq(text: str) -> set[int]:
    try:
        keep = {int(x) for x in text.split(",")}
    except ValueError:
        raise ValueError(f"--seq wants comma-separated lengths, e.g. 4096,8192, got {text!r}") from None
    if min(keep) < 1:
        raise ValueError(f"--seq: lengths must be >= 1, got {text!r}")
    return keep


def _check_output_path(option: str, path) -> None:
    """ValueError unless ``path`` can be written (its directory exists and is writable)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: {'is a directory' if os.path.isdir(path) else 'no directory ' + parent}")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise ValueError(f"{option} {path}: not writable")


def cmd_bench(args) -> int:
    if args.device == "cpu":
        device = "cpu"
    elif not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    else:
        device = "cuda"

    try:
        for name in ("json", "plot"):  # before the run, not after it
            _check_output_path(f"--{name}", getattr(args, name))
        if args.seq and args.shape:
            raise ValueError("--seq selects lengths of the presets' sweeps; --shape gives its own length")
        if args.shape:
            problems = [parse_shape(args.shape, args.dtype or ("fp32" if device == "cpu" else "bf16"),
                                    causal=not args.no_causal)]
        elif device == "cpu" and args.preset is None:
            problems = [parse_shape(CPU_DEFAULT_SHAPE, args.dtype or "fp32")]
        else:
            names = list(PRESETS) if args.preset in (None, "all") else [p.strip() for p in args.preset.split(",")]
            bad = [n for n in names if n not in PRESETS]
            if bad:
                raise ValueError(f"unknown preset {bad}; choose from {list(PRESETS)} or 'all'")
            if device == "cpu":  # the presets' tiny versions: a smoke run of their code paths
                problems = [p for n in names for p in preset_problems(n, tiny=True, dtype=args.dtype or "fp32")]
            else:
                problems = [p for n in names for p in preset_problems(n, dtype=args.dtype)]
            if args.seq:
                keep = _parse_seq(args.seq)
                lengths = sorted({p.n for p in problems})
                problems = [p for p in problems if p.n in keep]
                if not problems:
                    raise ValueError(f"--seq {args.seq} matches no problem of {', '.join(names)}"
                                     f"{' (the tiny CPU versions)' if device == 'cpu' else ''}; their lengths: "
                                     f"{','.join(map(str, lengths))}")
        if args.shape and args.preset:
            raise ValueError("give --preset or --shape, not both")
        for p in problems:
            if p.heads % max(1, p.kv_heads) or min(p.batch, p.heads, p.kv_heads, p.seq_q, p.seq_kv, p.head_dim) < 1:
                raise ValueError(f"invalid shape {p.label()}: need positive sizes and H % H_kv == 0")
            if p.window is not None and not p.causal:
                raise ValueError("a window needs causal attention (drop --no-causal)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    # Every registered system gets rows; on the CPU the CUDA-only ones say "unavailable".
    systems = [s.strip() for s in (args.systems or "").split(",") if s.strip()] or list(SYSTEMS)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"error: unknown system {unknown}; choose from {list(SYSTEMS)}", file=sys.stderr)
        return 2
    modes = list(MODES) if args.mode in (None, "all") else [args.mode]

    if device == "cuda" and not args.no_precompile and any(issubclass(SYSTEMS[s], FlashSink) for s in systems):
        _precompile(problems, device)
    if device == "cpu":  # a smoke run: a few repetitions are enough
        timer = Timer(device, rep_ms=min(args.rep_ms, 20.0), min_reps=3)
    else:
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)

    def save(res):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    # `timeout` sends SIGTERM: keep what was measured (table, JSON, plot of the problems done).
    def on_term(signum, frame):
        raise _Interrupted()

    old_handler = signal.signal(signal.SIGTERM, on_term)
    result: dict = {}
    interrupted = False
    try:
        run_bench(problems, systems=systems, modes=modes, device=device, timer=timer,
                  opts={"eager_max_gib": args.eager_max_gib}, profile=args.profile,
                  gate2=not args.no_gate2, seed=args.seed, result=result, on_problem=save)
    except (_Interrupted, KeyboardInterrupt):
        interrupted = True
        _say("interrupted: reporting the problems finished so far")
        if "ceilings" not in result:
            return 124
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    if interrupted:
        result["interrupted"] = True
    print(format_table(result), flush=True)
    if args.json:
        save(result)
        _say(f"wrote {args.json}")
    if args.plot:
        msg = plot(result, args.plot)
        _say(msg or f"wrote {args.plot}")
    failed = [r for r in result["rows"] if r["status"].startswith("FAIL")
              and (getattr(SYSTEMS.get(r["system"]), "required_gate", None) or r["system"] == "hf/flashsink")]
    if interrupted:
        return 124
    return 1 if failed else 0


class _Interrupted(Exception):
    pass


def add_parser(sub) -> None:
    from ._argtypes import seed

    p = sub.add_parser(
        "bench",
        help="benchmark flashsink against FlexAttention, FLA, SDPA and the eager reference",
        description="Gate every system against the fp64 reference (precision standard), then time it: "
        "ms, TFLOP/s over visible pairs, GB/s, floor from ceilings measured in the same run, peak memory, "
        "speedup over the best peer with sinks. Exit 1 if flashsink fails its gate; 2 without CUDA "
        "(unless --device cpu, a tiny smoke run).",
    )
    p.add_argument("--preset", help=f"comma-separated of {', '.join(PRESETS)} or 'all' (default all)")
    p.add_argument("--shape", help="custom problem B,H,HKV,N,D[,W] (N may be NQ:NK)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"),
                   help="input dtype of every problem (default: on cuda bf16 for --shape and each preset's own; "
                   "fp32 on cpu)")
    p.add_argument("--no-causal", action="store_true", help="--shape without the causal mask")
    p.add_argument("--seq", help="only these lengths of the presets' sweeps, e.g. 4096,8192 (decode: the KV-cache "
                   "length; varlen: the total tokens)")
    p.add_argument("--mode", choices=("fwd", "bwd", "fwd+bwd", "all"), help="default: all three")
    p.add_argument("--systems", help=f"comma-separated subset of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: tiny smoke run (flashsink CPU path and reference only; with --preset, the "
                   "presets shrunk to a few heads and tokens)")
    p.add_argument("--json", metavar="PATH", help="write all rows, gates and header as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    p.add_argument("--profile", action="store_true", help="per-kernel time table of flashsink's fwd+bwd")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (default 25 ms)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (default 100 ms)")
    p.add_argument("--eager-max-gib", type=float, default=48.0, help="skip eager above this score memory")
    p.add_argument("--no-gate2", action="store_true", help="gate 1 only (skips the low-precision reference)")
    p.add_argument("--no-precompile", action="store_true", help="compile flashsink kernels in-process")
    p.add_argument("--seed", type=seed, default=0, help="input seed in [0, 2**64) (default 0)")
    p.set_defaults(func=cmd_bench)
