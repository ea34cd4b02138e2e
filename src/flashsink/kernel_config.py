"""Static kernel configuration and the per-architecture tile table: the base module every layer imports
(it imports nothing of flashsink). Why each choice: docs/architecture.md, "Configuration choices".

Everything in :class:`KernelConfig` is baked into a compiled kernel, so it is part of the compile-cache
key; batch, lengths, window and scale are runtime arguments: a new length never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

#: Architectures we build for. sm_90a is Hopper with wgmma/TMA/setmaxnreg; sm_80 covers
#: Ampere and Ada (sm_86/sm_89 run sm_80 code).
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: ``precision=`` values: "fast" (the default) and "strict" (README, "Precision modes")
PRECISIONS = ("fast", "strict")
MAX_HEAD_DIM = 256
#: Head dims with tiles of their own; other multiples of 16 run zero-padded to the next one.
NATIVE_HEAD_DIMS = (32, 64, 128, 256)
#: the head dims :func:`kernel_head_dim` takes, for messages
HEAD_DIM_RULE = f"multiples of 16 up to {MAX_HEAD_DIM}"
#: head dims with attention_kvcache kernels (its cache is never padded: that would copy it every call)
KVCACHE_HEAD_DIMS = (64, 128)


def kernel_head_dim(d: int) -> int | None:
    """The head-dim rule: the kernels take :data:`HEAD_DIM_RULE`, each run with the next native head dim
    (returned; the inputs zero-padded up to it); None for a head dim no kernel takes."""
    if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
        return None
    for native in NATIVE_HEAD_DIMS:
        if d <= native:
            return native


#: log2(e): scores are kept in base 2 (one exp2 each), so the host folds it into the scale
LOG2E = 1.4426950408889634

# A window larger than any sequence, for calls without one: one kernel serves both (a runtime value).
NO_WINDOW = 1 << 30

# Row statistics (lse, Delta) and the fp32 dQ accumulator have a multiple of this many rows: every
# kernel's row tile is in bounds, and an fp32 [.., rows] row stride 16-byte aligned (bulk copies).
ROW_PAD = 128


def padded_rows(seq_q: int) -> int:
    """Rows of a padded batch's statistics: whole ROW_PAD tiles, at least one."""
    rows = (seq_q + ROW_PAD - 1) // ROW_PAD * ROW_PAD
    if isinstance(rows, int):  # eager: plain ints (torch.sym_max costs microseconds per call)
        return max(ROW_PAD, rows)
    # a torch.compile trace: symbolic lengths, no guard on seq_q
    return torch.sym_max(ROW_PAD, rows)


def varlen_rows(total: int) -> int:
    """Rows of a packed batch's statistics (``dense._stat_shape`` for ``thd``): whole row tiles of
    the last sequence may start at any packed row, so one tile past the end."""
    return padded_rows(total + ROW_PAD)


@dataclass(frozen=True)
class KernelConfig:
    arch: str  # "sm_80" or "sm_90a"
    dtype: str  # "float16" or "bfloat16"
    head_dim: int
    head_dim_v: int
    groups: int  # query heads per KV head
    causal: bool
    has_sinks: bool
    layout: str  # "bhsd", "bshd" or "thd" (packed varlen, cu_seqlens at runtime)
    deterministic: bool
    # "fast": single-term fp16/bf16 products, Delta = rowsum(dO * O) (FA4/FLA/flex's error class);
    # "strict": two-term products, Delta from P * dP (the precision standard). No default here
    precision: str

    @property
    def hopper(self) -> bool:
        return self.arch == "sm_90a"

    def target(self) -> dict:
        return {"kind": "cuda", "arch": self.arch}

    def short(self) -> str:
        w = "causal" if self.causal else "full"
        s = "sink" if self.has_sinks else "nosink"
        det = "-det" if self.deterministic else ""
        fast = "-fast" if self.precision == "fast" else ""
        return (
            f"{self.arch}-{self.dtype}-D{self.head_dim}x{self.head_dim_v}-G{self.groups}-{w}-{s}-{self.layout}{det}{fast}"
        )


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    threads: int
    stages: int


def fwd_tiles(cfg: KernelConfig) -> Tiles:
    """Forward tiles; on Hopper at head dim 64 the warp-specialized kernel's three consumer warpgroups
    (``threads`` is its consumers'; perf-log v9)."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper:
        if d <= 64:
            return Tiles(192, 128, 384, 2) if fwd_ws(cfg) else Tiles(128, 128, 256, 2)
        if d <= 128:
            return Tiles(128, 128, 256, 2)
        return Tiles(128, 64, 256, 1)
    if d <= 128:
        return Tiles(128, 64, 256, 2)
    return Tiles(64, 64, 128, 1)


def bwd_tiles(cfg: KernelConfig) -> Tiles:
    """Main backward tiles: ``block_n`` keys resident (dK, dV in registers), ``block_m`` query rows
    streaming. Hopper D256: 128 keys over two warpgroups (perf-log v6)."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper:
        if bwd_dq_first(cfg):
            return Tiles(128, 128, 256, 2)
        if d <= 128:
            return Tiles(64, 128, 256, 2)
        return Tiles(32, 128, 256, 1)
    return Tiles(32, 64, 128, 1)


def bwd_dq_bulk(cfg: KernelConfig) -> bool:
    """Whether TileLang's main backward adds dQ by one bulk (TMA) reduce-add per tile, not atomics (perf-log v6)."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_overlap(cfg: KernelConfig) -> bool:
    """Whether TileLang's main backward issues S^T and dP^T back to back, computing P meanwhile (perf-log v6)."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_ws(cfg: KernelConfig) -> bool:
    """Whether the main backward is ``bwd_ws.py``'s: Hopper, fast up to head dim 128, strict at 64 (perf-log
    v7, v10, v13)."""
    if not cfg.hopper:
        return False
    if cfg.precision == "strict":
        return cfg.head_dim == cfg.head_dim_v == 64
    return max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_dq_first(cfg: KernelConfig) -> bool:
    """Whether ``bwd_ws.py`` issues each tile's dQ product before dK's, handing dQ over while dK's runs,
    on 128-row tiles: fast, head dim 64, causal, padded layouts (perf-log v12)."""
    return (bwd_ws(cfg) and cfg.precision == "fast" and cfg.head_dim == cfg.head_dim_v == 64 and cfg.causal
            and cfg.layout != "thd")


def bwd_branch(cfg: KernelConfig) -> bool:
    """Whether TileLang's main backward skips the per-element mask on wholly visible row blocks (perf-log v11)."""
    return cfg.hopper and cfg.precision == "strict"


def bwd_swap(cfg: KernelConfig) -> bool:
    """Whether TileLang's main backward takes its KV tiles longest first from the grid's layout (perf-log v10, v11)."""
    return cfg.layout != "thd"


def fwd_mask(cfg: KernelConfig) -> str:
    """How the pipelined forward masks its logits (``fwd.build_fwd_pipelined``'s ``mask``): ``"branch"``
    on Hopper, ``"select"`` elsewhere."""
    return "branch" if cfg.hopper else "select"


def fwd_ws(cfg: KernelConfig) -> bool:
    """Whether the forward is ``fwd_ws.py``'s: Hopper, equal head dims 64 or 128 (perf-log v9)."""
    return cfg.hopper and cfg.head_dim == cfg.head_dim_v and cfg.head_dim in (64, 128)


def pack_gqa_fits(cfg: KernelConfig, block_m: int) -> bool:
    """Whether ``fwd_ws.build_fwd_ws(pack_gqa=True)`` can pack a GQA group's query heads into one
    ``block_m``-row tile: head dims 64 and 128 (one TMA box per 64 columns), a group of at least two
    heads that divides ``block_m`` into whole 8-row swizzle atoms."""
    g = cfg.groups
    return cfg.head_dim in (64, 128) and g >= 2 and block_m % g == 0 and (block_m // g) % 8 == 0


#: the windowed kind's rows at head dim 64 where the group packs into them (perf-log v28, v29)
FWD_WINDOW_ROWS_D64 = 256

#: the widest window that launches the kind ``fwd_window`` (perf-log v19)
WINDOW_TILES_MAX = 128


def fwd_window_tiles(cfg: KernelConfig) -> Tiles:
    """``fwd_window``'s tiles: 64 keys, three K/V ring slots, the first rows the GQA group packs into
    (:data:`FWD_WINDOW_ROWS_D64` or 192 at head dim 64, 128 at 128); causal, and at head dim 128 padded
    layouts only; elsewhere :func:`fwd_tiles` (perf-log v19, v24)."""
    if fwd_ws(cfg) and cfg.causal and (cfg.head_dim == 64 or cfg.layout != "thd"):
        rows = dict.fromkeys([FWD_WINDOW_ROWS_D64, 192]) if cfg.head_dim == 64 else [128]
        for bm in rows:  # the first that the group packs into
            if pack_gqa_fits(cfg, bm):
                return Tiles(bm, 64, 2 * bm, 3)
    return fwd_tiles(cfg)


@functools.lru_cache(maxsize=None)
def fwd_windowed(cfg: KernelConfig) -> bool:
    """Whether a window of at most :data:`WINDOW_TILES_MAX` keys launches ``fwd_window``: where its tiles
    differ from the forward's (cached: asked on every call)."""
    return fwd_window_tiles(cfg) != fwd_tiles(cfg)


def fwd_ws_options(cfg: KernelConfig, tiles: Tiles | None = None, window: bool = False) -> dict:
    """``fwd_ws.build_fwd_ws``'s ``epilogue``, ``q_slots`` and ``pack_gqa`` for the kinds ``fwd`` and
    ``fwd_unfolded`` at ``tiles`` (default :func:`fwd_tiles`), or (``window``) ``fwd_window``:
    head dim 64 "regs", two Q slots, packed where :func:`pack_gqa_fits`; head dim 128 "wg", one slot;
    windowed, :func:`_window_epilogue`, two slots, packed; elsewhere "smem" and one slot
    (strict's ``fwd_o32`` keeps those)."""
    if fwd_ws(cfg) and cfg.head_dim == 64:
        bm = (tiles or fwd_tiles(cfg)).block_m
        epilogue = _window_epilogue(cfg) if window and fwd_windowed(cfg) else "regs"
        return {"epilogue": epilogue, "q_slots": 2, "pack_gqa": pack_gqa_fits(cfg, bm)}
    epilogue = "wg" if fwd_ws(cfg) and cfg.head_dim == 128 else "smem"
    if window and fwd_windowed(cfg):  # head dim 128's windowed tiles pack (fwd_window_tiles)
        epilogue = _window_epilogue(cfg) if epilogue == "wg" else epilogue
        return {"epilogue": epilogue, "q_slots": 1 if epilogue == "smem" else 2, "pack_gqa": True}
    return {"epilogue": epilogue, "q_slots": 1}


def _window_epilogue(cfg: KernelConfig) -> str:
    """The windowed kind's epilogue: "tma", but "wg" in packed batches (a TMA box past one sequence's last
    row would write into the next's)."""
    return "wg" if cfg.layout == "thd" else "tma"


def fwd_o32(cfg: KernelConfig) -> bool:
    """Whether strict's forward, when a backward follows, is ``fwd_o32`` (two-term P @ V, O in fp32 too for
    ``preprocess_o32``'s Delta): strict, :func:`fwd_ws`, padded layouts (perf-log v13)."""
    return cfg.precision == "strict" and fwd_ws(cfg) and cfg.layout != "thd"


def fwd_o32_tiles(cfg: KernelConfig) -> Tiles:
    """``fwd_o32``'s tiles: two consumer warpgroups (D64's three spill with P's second term)."""
    return Tiles(128, 128, 256, 2)


def fwd_fold(cfg: KernelConfig) -> bool:
    """Whether the forward folds the scale into the exponent's FMA (:func:`fwd_ws`); right for a positive
    scale only: ``scale <= 0`` launches ``fwd_unfolded`` (perf-log v10, v11)."""
    return fwd_ws(cfg)


#: query heads of a GQA group per program in the split main backward: at most this many programs
#: share one (KV tile, KV head)
MAX_BWD_SPLIT = 8


def bwd_split(cfg: KernelConfig) -> int:
    """Programs per (KV tile, KV head) of ``bwd_split``, each streaming ``groups / split`` query heads: the
    largest divisor of the group up to :data:`MAX_BWD_SPLIT`; 1 (no split kernel) for strict or
    deterministic configurations, unequal head dims, off Hopper, and where :func:`bwd_ws` runs unsplit
    (perf-log v6, v10)."""
    if cfg.deterministic or cfg.precision != "fast" or cfg.head_dim != cfg.head_dim_v or not cfg.hopper:
        return 1
    if bwd_ws(cfg) and not bwd_head_major(cfg):
        return 1
    return max(d for d in range(1, MAX_BWD_SPLIT + 1) if cfg.groups % d == 0)


def bwd_head_major(cfg: KernelConfig) -> bool:
    """Whether ``bwd_ws.py``'s split kernel is launched head by head (FlashAttention-4's grid): fast,
    padded layouts, head dims above 64 up to 128 (perf-log v33)."""
    return (bwd_ws(cfg) and cfg.precision == "fast" and not cfg.deterministic and cfg.head_dim == cfg.head_dim_v
            and 64 < cfg.head_dim <= 128 and cfg.layout != "thd")


#: the split main backward runs when the rows one KV tile can see reach this many (perf-log v6)
BWD_SPLIT_MIN_ROWS = 1024


def pre_branch(cfg: KernelConfig) -> bool:
    """Whether the strict preprocess skips the per-element mask on wholly visible KV tiles (perf-log v12)."""
    return cfg.hopper and cfg.precision == "strict"


def pre_lpt(cfg: KernelConfig) -> bool:
    """Whether the strict preprocess takes its causal query tiles most keys first (perf-log v12)."""
    return pre_branch(cfg) and cfg.layout != "thd"


def pre_tiles(cfg: KernelConfig) -> Tiles:
    """Backward preprocess: strict, Delta from P and dP (query-stationary); fast, from O and dO
    (elementwise, ``block_n`` unused)."""
    if cfg.precision == "fast":
        return Tiles(ROW_BLOCK, ROW_BLOCK, 128, 1)
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper and d <= 128:
        return Tiles(128, 64, 256, 2)
    return Tiles(64, 64, 128, 1)


def pre_o32_tiles(cfg: KernelConfig) -> Tiles:
    """``preprocess_o32``'s tiles: the fast preprocess's (the same memory-bound pass, over an fp32 O)."""
    return pre_tiles(dataclasses.replace(cfg, precision="fast"))


def dq_tiles(cfg: KernelConfig) -> Tiles:
    """Deterministic dQ pass: query rows stay resident, keys stream through."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper and d <= 128:
        return Tiles(64, 64, 128, 2)
    return Tiles(64, 32, 128, 1)


#: Query rows of one packed split-KV tile (all heads of a GQA group x all query rows).
SPLIT_ROWS = 64


def split_tiles(cfg: KernelConfig) -> Tiles:
    """Split-KV forward (decode, the paged cache): one packed row tile, keys streaming through."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper:
        return Tiles(SPLIT_ROWS, 128 if d <= 128 else 64, 128, 2)
    return Tiles(SPLIT_ROWS, 64, 128, 2 if d <= 128 else 1)


ROW_BLOCK = 64  # rows per block of the elementwise kernels (preprocess, postprocess)


def arch_of(device: torch.device) -> str:
    """Map a CUDA device to the architecture we build for, or raise NotImplementedError."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _arch_of_index(index)


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    # cached: asked on every call, and the driver query costs microseconds of host time
    device = torch.device("cuda", index)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 8:
        # Ampere and Ada run the portable path, compiled for their own arch.
        return f"sm_{major}{minor}"
    name = torch.cuda.get_device_name(device)
    raise NotImplementedError(
        f"flashsink kernels support NVIDIA GPUs of compute capability 8.x (sm_80, sm_86, sm_89) "
        f"and 9.0 (sm_90a, Hopper); {name} is sm_{major}{minor}. "
        "Move the tensors to the CPU to use the reference implementation."
    )
