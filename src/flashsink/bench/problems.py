"""The bench's problems: presets, :class:`Problem`, and the work of each (visible pairs, FLOPs,
the fewest bytes), plus its random inputs."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
from dataclasses import dataclass

import torch

from .. import testing
from ..visibility import visible_pairs


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
    # hf-train: a GptOssForCausalLM training step (bench.hf) over seq_q tokens, not one attention call
    hf_train: bool = False
    # decode-paged: the page size of the paged KV cache (flashsink.attention_kvcache with a block table)
    page_size: int | None = None
    # stack (bench.stack): the window of each layer of a chain (None: full causal); each layer's output is
    # the next layer's query, one backward from the last (STACK_PRESETS)
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return testing.resolve_dtype(self.dtype)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def kind(self) -> str:
        if self.hf_train:
            return "hf-train"
        if self.layer_windows is not None:
            return "stack"
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
        if self.layer_windows is not None:  # a stack: the layers' windows, then the batch
            ws = self.layer_windows
            kinds = " + ".join(f"{ws.count(x)} " + ("full" if x is None else f"W={x}") for x in dict.fromkeys(ws))
            if self.seqlens is None:
                docs = f"B={self.batch} N={self.seq_q}"
            elif len(set(self.seqlens)) == 1:
                docs = f"T={self.tokens_q} ({len(self.seqlens)} docs of {self.seqlens[0]})"
            else:
                docs = f"T={self.tokens_q} ({len(self.seqlens)} docs, len {lengths_summary(self.seqlens)})"
            return (f"{self.preset} stack of {len(ws)} layers ({kinds}) {docs} H={self.heads} Hkv={self.kv_heads} "
                    f"D={self.head_dim} {self.dtype}")
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
    # A Hugging Face GptOssForCausalLM training step (bench.hf): gpt-oss attention shapes, 2 layers
    # (sliding W, full), 16k tokens; attn_implementation flashsink vs flex_attention vs eager.
    "hf-train": ("bf16", 1, 64, 8, 64, 128, (16384,)),
    # decode against a paged KV cache (pages of PAGE_SIZE, a random block table) next to the contiguous
    # cache and the peers' contiguous decode
    "decode-paged": ("bf16", 8, 64, 8, 64, None, (4096, 16384, 65536)),
    # The gpt-oss attention stack (bench.stack): 24 layers alternating W (first, as gpt-oss) and full
    # causal, each layer's output the next one's query, fwd+bwd, on a packed batch of B documents of N
    # tokens (32k tokens a step)
    "gptoss-stack-4k": ("bf16", 8, 64, 8, 64, 128, (4096,)),
    "gptoss-stack-16k": ("bf16", 2, 64, 8, 64, 128, (16384,)),
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
    "gptoss-stack-4k": ("bf16", 3, 4, 2, 16, 8, (16,)),
    "gptoss-stack-16k": ("bf16", 2, 4, 2, 16, 8, (24,)),
}
MODES = ("fwd", "bwd", "fwd+bwd")
VARLEN_PRESETS = ("varlen",)
DECODE_PRESETS = ("decode", "decode-paged")
PAGE_SIZE = {"decode-paged": 256}  # tiny presets: TINY_PAGE_SIZE
TINY_PAGE_SIZE = 16
HF_PRESETS = ("hf-train",)
STACK_PRESETS = ("gptoss-stack-4k", "gptoss-stack-16k")
STACK_LAYERS = 24  # gpt-oss: 12 sliding + 12 full
TINY_STACK_LAYERS = 4  # --device cpu: the same alternation, 2 + 2 (the CPU paths are slow)
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
    if name in STACK_PRESETS:  # b documents of n tokens each, packed
        lens = (seqs[0],) * b
        layers = tuple(w if i % 2 == 0 else None for i in range(TINY_STACK_LAYERS if tiny else STACK_LAYERS))
        return [Problem(name, b, h, hk, seqs[0], seqs[0], d, w, dt, seqlens=lens, layer_windows=layers)]
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
# Work: pairs (flashsink.visibility), FLOPs, bytes

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


def _layers(prob: Problem) -> list[Problem]:
    """A stack's layers as single-layer problems (its own window each); else [prob]."""
    if prob.layer_windows is None:
        return [prob]
    return [dataclasses.replace(prob, window=w, layer_windows=None) for w in prob.layer_windows]


def flops(prob: Problem, mode: str) -> int:
    if prob.layer_windows is not None:  # a stack: the sum of its layers'
        return sum(flops(p, mode) for p in _layers(prob))
    return FLOP_FACTOR[mode] * prob.heads * problem_pairs(prob) * prob.head_dim


def min_bytes(prob: Problem, mode: str) -> int:
    """Fewest bytes the mode must move through device memory: every input read once, every
    output written once. fwd: read q, k, v; write o. bwd: read q, k, v, do; write dq, dk, dv
    (the small lse / Delta rows, the sinks and cu_seqlens are left out). fwd+bwd: both, o written
    once. Decode (one query row per sequence) is almost all K/V-cache reads. A stack: the sum of its
    layers'."""
    if prob.layer_windows is not None:
        return sum(min_bytes(p, mode) for p in _layers(prob))
    es = prob.torch_dtype.itemsize
    q = prob.heads * prob.tokens_q * prob.head_dim * es
    kv = prob.kv_heads * prob.tokens_kv * prob.head_dim * es
    fwd = q + 2 * kv + q  # q, k, v in; o out
    bwd = q + 2 * kv + q + q + 2 * kv  # q, k, v, do in; dq, dk, dv out
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": bwd + q}[mode]


def new_row(prob: Problem, system: str, mode: str, note: str, ceil: dict) -> dict:
    """One row of the bench's results (``run_bench``, the stack's rows add their own keys): the problem,
    the system, empty outcome fields, the mode's FLOPs and bytes, and the floor from the measured
    ceilings ``ceil`` (:func:`.timing.measure_ceilings`): the slower of FLOPs at the matmul rate and
    bytes at the copy rate, in ms, with which of the two bounds it ("bound")."""
    row = {
        "preset": prob.preset, "problem": prob.label(), "N": prob.n, "mode": mode, "system": system,
        "kind": prob.kind, "window": prob.window,
        "note": note, "status": "", "gate": None, "gate_fails": "", "ms": None, "host_us": None, "tflops": None,
        "gbs": None, "floor_ms": None, "pct_floor": None, "peak_mib": None, "speedup": None,
        "flops": flops(prob, mode), "bytes": min_bytes(prob, mode),
    }
    row["floor_ms"] = max(row["flops"] / (ceil["matmul_tflops"] * 1e12), row["bytes"] / (ceil["copy_gbs"] * 1e9)) * 1e3
    row["bound"] = "flops" if row["flops"] / ceil["matmul_tflops"] / 1e3 >= row["bytes"] / ceil["copy_gbs"] else "bytes"
    return row


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
