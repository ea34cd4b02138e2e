"""The GPU test matrix, shared by tests/test_kernels_gpu.py and the precompile step of
tools/gpu_suite.sh (which builds exactly these kernels in parallel before pytest runs)."""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    head_dim: int
    window: int | None
    dtype: torch.dtype
    seq_kv: int | None = None
    causal: bool = True
    sinks: bool = True
    layout: str = "bhsd"
    sink_range: tuple = (-2.0, 2.0)
    name: str = field(default="", compare=False)

    @property
    def skv(self) -> int:
        return self.seq_q if self.seq_kv is None else self.seq_kv


F16, BF16 = torch.float16, torch.bfloat16
HEADS = [(8, 8), (12, 4), (16, 1), (64, 8)]


def main_matrix() -> list:
    """B x (H, H_kv) x N x D x W x dtype, thinned so every value of every axis appears with
    every other axis' common values, but not the full product (that is hours of references)."""
    cases = []
    lengths = [1, 17, 128, 1000]
    windows = [None, 1, 100, 128, "ge"]
    i = 0
    for dtype in (F16, BF16):
        for d in (64, 128):
            for h, hk in HEADS:
                for n in lengths:
                    w = windows[i % len(windows)]
                    i += 1
                    w = (n + 7) if w == "ge" else w
                    b = 2 if (i % 3 == 0) else 1
                    cases.append(Case(b, h, hk, n, d, w, dtype))
    return cases


def named_cases() -> list:
    return [
        Case(1, 64, 8, 4096, 128, 128, F16, name="golden"),
        Case(1, 64, 8, 4096, 64, 128, BF16, name="gptoss-swa"),
        Case(1, 64, 8, 4096, 64, None, BF16, name="gptoss-full"),
        Case(2, 16, 1, 4096, 128, None, F16, name="mqa-4k-causal"),
        Case(1, 12, 4, 4096, 64, 100, BF16, name="gqa3-4k-w100"),
        # long enough for the split main backward (BWD_SPLIT_MIN_ROWS), at lengths off the tiles
        Case(2, 12, 4, 1500, 64, None, BF16, name="gqa3-1500-causal"),
        Case(1, 8, 2, 1100, 128, 1050, F16, name="gqa4-1100-w1050"),
        # gpt-oss's GQA at D128, full causal past BWD_SPLIT_MIN_ROWS: the head-major split backward
        # (config.bwd_head_major), one program per query head
        Case(1, 64, 8, 2048, 128, None, BF16, name="gqa8-2k-d128-causal"),
    ]


def extra_cases() -> list:
    """Shapes and options off the main grid: seq_q < seq_kv, extreme sinks, no sinks, bshd,
    non-causal, odd head dims."""
    return [
        Case(2, 8, 8, 100, 128, None, BF16, seq_kv=1000, name="chunked-prefill"),
        Case(1, 12, 4, 1, 64, None, F16, seq_kv=777, name="decode-1"),
        Case(1, 16, 1, 129, 64, 64, BF16, seq_kv=4096, name="prefill-window"),
        # more queries than keys: the first rows see no key (o = 0, lse = the sink)
        Case(1, 8, 2, 300, 64, None, BF16, seq_kv=200, name="more-queries-than-keys"),
        Case(1, 8, 2, 300, 64, 50, BF16, seq_kv=200, name="more-queries-than-keys-window"),
        Case(1, 8, 8, 1000, 128, 100, F16, sink_range=(-30.0, -30.0), name="sink-30"),
        Case(1, 8, 8, 1000, 128, None, BF16, sink_range=(10.0, 10.0), name="sink+10"),
        Case(2, 12, 4, 1000, 64, 128, BF16, sinks=False, name="nosink"),
        Case(2, 12, 4, 1000, 128, None, F16, sinks=False, name="nosink-full"),
        Case(2, 12, 4, 1000, 64, 100, BF16, layout="bshd", name="bshd"),
        Case(1, 8, 8, 1000, 64, None, BF16, causal=False, name="noncausal"),
        Case(1, 8, 2, 333, 32, 50, F16, name="d32"),
        Case(1, 8, 2, 333, 80, None, BF16, name="d80"),
        Case(1, 8, 2, 333, 96, 100, F16, name="d96"),
        Case(1, 8, 2, 333, 256, 100, BF16, name="d256"),
    ] + decode_cases()


def decode_cases() -> list:
    """Few query rows against long caches: these run the split-KV forward (ops/launch/decode.py)."""
    return [
        Case(4, 64, 8, 1, 64, None, BF16, seq_kv=5000, name="decode-split"),
        Case(2, 16, 1, 1, 128, None, F16, seq_kv=20000, name="decode-split-mqa"),
        Case(1, 32, 8, 4, 64, None, BF16, seq_kv=3000, layout="bshd", name="decode-split-4rows-bshd"),
        Case(2, 8, 8, 1, 64, None, BF16, seq_kv=2000, sinks=False, name="decode-split-nosink"),
        Case(1, 64, 8, 1, 64, 1000, BF16, seq_kv=9000, name="decode-split-window"),
        Case(1, 8, 2, 1, 256, None, BF16, seq_kv=3000, name="decode-split-d256"),
    ]


def all_cases() -> list:
    return main_matrix() + named_cases() + extra_cases()


#: extra cases that also run in fast mode (the others are strict only: each case is a kernel set)
FAST_EXTRA = ("chunked-prefill", "bshd", "noncausal", "nosink")


def fast_cases() -> list:
    """The cases run in fast mode too: the main matrix at gpt-oss's GQA (64/8) and at MQA (16/1),
    every dtype, head dim, length and window; the named problems; a few off-grid options. Fast
    mode's kernels are the strict ones less the two-term products and with Delta from O: the
    strict matrix covers the shared code (masks, layouts, block ranges) everywhere."""
    main = [c for c in main_matrix() if (c.heads, c.kv_heads) in ((64, 8), (16, 1))]
    return main + named_cases() + [c for c in extra_cases() if c.name in FAST_EXTRA]


def case_config(arch: str, c, *, layout=None, deterministic=False, precision="strict"):
    """The KernelConfig a case (``Case`` or ``VarlenCase``) runs with on ``arch``."""
    from flashsink.kernel_config import SUPPORTED_DTYPES, KernelConfig
    from flashsink.ops.launch.dense import _kernel_dim

    return KernelConfig(
        arch=arch, dtype=SUPPORTED_DTYPES[c.dtype], head_dim=_kernel_dim(c.head_dim),
        head_dim_v=_kernel_dim(c.head_dim), groups=c.heads // c.kv_heads, causal=c.causal,
        has_sinks=c.sinks, layout=layout or c.layout, deterministic=deterministic, precision=precision,
    )


def kernel_configs(arch: str, cases=None):
    """The KernelConfigs the cases need on ``arch``: strict for every case, fast for
    :func:`fast_cases` (deterministic and varlen variants included, in both modes)."""
    return (
        [case_config(arch, c) for c in cases or all_cases()]
        + [case_config(arch, c, precision="fast") for c in cases or fast_cases()]
        + [case_config(arch, c, deterministic=True, precision=p) for c in determinism_cases() for p in ("fast", "strict")]
        + varlen_kernel_configs(arch, "strict") + varlen_kernel_configs(arch, "fast")
    )


def determinism_cases() -> list:
    return [Case(1, 64, 8, 1000, 128, 128, F16, name="det-golden-ish"), Case(2, 12, 4, 333, 64, None, BF16, name="det-gqa3")]


# -- packed variable-length batches (flashsink.attention_varlen, layout "thd") ------------------


@dataclass(frozen=True)
class VarlenCase:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    lens_q: tuple
    lens_k: tuple | None = None  # None: the same as lens_q
    window: int | None = None
    causal: bool = True
    sinks: bool = True
    deterministic: bool = False
    name: str = field(default="", compare=False)

    @property
    def lk(self) -> tuple:
        return self.lens_q if self.lens_k is None else self.lens_k


def _lens(seed: int, n: int, lo: int, hi: int, extra=()) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(extra) + tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g))


def varlen_cases() -> list:
    """Random lengths with 0 and 1 among them, a 16k sequence, thousands of sequences, fewer
    and more queries than keys per sequence, decode rows, odd head dims; lengths at and around
    multiples of the 64- and 128-row tiles (where the packed schedule, ops/tir/schedule.py, leaves a
    sequence an idle program or none)."""
    mixed = _lens(1, 18, 2, 600, extra=(0, 1))
    edges = (128, 1, 127, 129, 0, 64, 63, 65, 256, 192, 255, 257, 128)
    edges_k = (200, 64, 128, 1, 5, 129, 0, 300, 256, 1, 255, 128, 384)
    return [
        VarlenCase(8, 2, 64, BF16, mixed, name="gqa4-causal"),
        VarlenCase(12, 4, 128, F16, mixed, window=100, name="gqa3-window100"),
        VarlenCase(64, 8, 64, BF16, _lens(2, 16, 1, 1000), window=128, name="gptoss-swa"),
        VarlenCase(64, 8, 64, BF16, _lens(2, 16, 1, 1000), name="gptoss-full"),
        VarlenCase(8, 8, 64, BF16, (5, 100, 1, 0, 64, 3), (300, 100, 1000, 7, 64, 0), name="chunked-prefill"),
        VarlenCase(8, 2, 64, BF16, (300, 17, 200), (200, 5, 200), window=50, name="more-queries-than-keys"),
        VarlenCase(64, 8, 64, BF16, (1,) * 24, _lens(3, 24, 1, 3000), name="decode"),
        VarlenCase(64, 8, 64, BF16, (1,) * 24, _lens(3, 24, 1, 3000), window=128, name="decode-window"),
        VarlenCase(8, 8, 64, BF16, mixed, _lens(4, 20, 0, 500), causal=False, name="noncausal"),
        VarlenCase(12, 4, 64, F16, mixed, window=128, sinks=False, name="nosink"),
        VarlenCase(4, 1, 64, BF16, _lens(5, 2000, 0, 20), name="2000-seqs"),
        VarlenCase(2, 1, 64, BF16, (0, 1, 16384, 5, 700), name="16k"),
        VarlenCase(2, 1, 64, BF16, (0, 1, 16384, 5, 700), window=128, name="16k-window"),
        VarlenCase(4, 2, 32, F16, mixed, window=64, name="d32"),
        VarlenCase(4, 2, 96, BF16, mixed, name="d96"),
        VarlenCase(4, 2, 256, BF16, mixed, window=100, name="d256"),
        VarlenCase(8, 2, 64, BF16, mixed, window=100, deterministic=True, name="deterministic"),
        VarlenCase(8, 2, 64, BF16, edges, name="tile-edges"),
        VarlenCase(8, 2, 64, BF16, edges, edges_k, window=100, name="tile-edges-keys"),
        VarlenCase(8, 2, 64, BF16, edges, edges_k, window=100, deterministic=True, name="tile-edges-deterministic"),
    ]


def varlen_kernel_configs(arch: str, precision: str = "strict") -> list:
    return [case_config(arch, c, layout="thd", deterministic=c.deterministic, precision=precision)
            for c in varlen_cases()]


# -- attention_kvcache: decode and chunked prefill against a (paged) KV cache --------------------


@dataclass(frozen=True)
class KVCase:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    lengths: tuple  # cache_seqlens, one per batch row
    page_size: int | None  # None: a contiguous cache [B, S_max, H_kv, D]
    seq_q: int = 1
    window: int | None = None
    sinks: bool = True
    shared: bool = False  # every row's first pages are row 0's (prefix sharing)
    name: str = field(default="", compare=False)


def kvcache_cases() -> list:
    """Page sizes 1-256 (and an odd 48), lengths 1..64k in one batch, windows, sinks or none, GQA
    64/8 and others, D 64/128, bf16/fp16, shared pages, a row shorter than its chunk, a contiguous cache."""
    mixed = _lens(7, 7, 1, 5000, extra=(1,))
    return [
        KVCase(64, 8, 64, BF16, mixed, 16, name="decode-p16"),
        KVCase(64, 8, 128, F16, (65536, 3, 1000), 256, name="decode-p256-64k"),
        KVCase(64, 8, 64, BF16, mixed, 32, window=128, name="decode-p32-w128"),
        KVCase(64, 8, 128, BF16, mixed, 64, sinks=False, name="decode-p64-nosink"),
        KVCase(64, 8, 64, F16, mixed, 128, shared=True, name="decode-p128-shared"),
        KVCase(64, 8, 64, BF16, (3000, 777, 2), 48, name="decode-p48"),
        KVCase(8, 2, 64, BF16, (40, 1, 17), 1, name="decode-p1"),
        KVCase(16, 1, 128, BF16, (20000, 5), 16, name="decode-mqa"),
        KVCase(8, 8, 64, F16, (300, 4096), 32, name="decode-mha"),
        KVCase(64, 8, 64, BF16, (1, 3000, 9000), None, name="decode-contiguous"),
        KVCase(64, 8, 128, F16, (1, 3000, 9000), None, window=1000, name="decode-contiguous-w1000"),
        KVCase(64, 8, 64, BF16, (200, 1000), 128, seq_q=64, window=100, name="chunk64-p128-w100"),
        KVCase(64, 8, 128, BF16, (5, 1500, 64), 16, seq_q=64, shared=True, name="chunk64-p16-short-row"),
        KVCase(16, 1, 64, F16, (700, 33), 64, seq_q=9, name="chunk9-mqa"),
        KVCase(8, 2, 128, BF16, (2048, 513), 256, seq_q=300, sinks=False, name="chunk300-p256"),
        KVCase(12, 4, 64, F16, (4000, 100), None, seq_q=16, window=64, name="chunk16-contiguous"),
    ]


def kvcache_config(arch: str, c):
    from flashsink.kernel_config import SUPPORTED_DTYPES, KernelConfig

    return KernelConfig(
        arch=arch, dtype=SUPPORTED_DTYPES[c.dtype], head_dim=c.head_dim, head_dim_v=c.head_dim,
        groups=c.heads // c.kv_heads, causal=True, has_sinks=c.sinks, layout="bshd",
        deterministic=False, precision="strict",
    )


def merge_test_config(arch: str):
    """The fp32 merge kernel that test_kvcache_gpu.py judges against its torch twin."""
    from flashsink.kernel_config import KernelConfig

    return KernelConfig(arch=arch, dtype="float32", head_dim=64, head_dim_v=64, groups=1, causal=True,
                        has_sinks=True, layout="bhsd", deterministic=False, precision="strict")


def combine_splits(o_part, lse_part, sinks32, has_sinks: bool):
    """The merge kernel's (``merge_splits.py``) torch twin, which test_decode.py and test_kvcache_gpu.py
    judge it and the split algebra against: ``[B, H, Sq, S, Dv]`` / ``[B, H, Sq, S]`` fp32 partials (the
    kernel's layout: splits next to the head dim, as ``flashsink.combine.merge_stacked`` takes them) -> o
    ``[B, H, Sq, Dv]`` and lse ``[B, H, Sq]``, fp32. A split that saw no key (lse -inf) is ignored,
    whatever its o holds. (Test code only: the library launches the kernel.)"""
    from flashsink.combine import merge_stacked

    terms = lse_part
    if has_sinks:
        sink = sinks32.view(1, -1, 1, 1).expand(*lse_part.shape[:3], 1)
        terms = torch.cat([lse_part, sink], dim=-1)  # the sink: one more term, with no value
    return merge_stacked(o_part, terms)
