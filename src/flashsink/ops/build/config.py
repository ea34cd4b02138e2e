"""Static kernel configuration and the per-architecture tile table.

Everything in :class:`KernelConfig` is baked into a compiled kernel and is therefore
part of the compile-cache key. Batch, sequence lengths, the window size and the
softmax scale are runtime arguments: a new length never recompiles.
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
#: head dims with attention_kvcache kernels (ops/launch/kvcache.py: the cache is never padded, that would copy it
#: every call)
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

# A window larger than any sequence: used when the caller asked for no window, so one
# kernel serves windowed and full causal attention (the window is a runtime value).
NO_WINDOW = 1 << 30

# Row statistics (lse, Delta) and the fp32 dQ accumulator are allocated with this many
# rows per multiple: every kernel's row tile is then in bounds, and the row stride of
# an fp32 [.., rows] tensor stays 16-byte aligned as the bulk-copy engine requires.
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
    deterministic: bool = False
    # "fast": single-term fp16/bf16 products and Delta = rowsum(dO * O) (FA4/FLA/flex's error class);
    # "strict": two-term products and Delta from P * dP (the seed's precision standard)
    precision: str = "strict"

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
    """Main backward tiles: ``block_n`` keys stay resident (dK, dV accumulate in
    registers), ``block_m`` query rows stream through."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper:
        if bwd_dq_first(cfg):
            return Tiles(128, 128, 256, 2)
        if d <= 128:
            return Tiles(64, 128, 256, 2)
        # D=256: 128 resident keys over two warpgroups (a 64-key tile gives the P^T
        # fragment and the MMA operand layouts TileLang cannot reconcile).
        return Tiles(32, 128, 256, 1)
    if d <= 128:
        return Tiles(32, 64, 128, 1)
    return Tiles(32, 64, 128, 1)


def bwd_dq_bulk(cfg: KernelConfig) -> bool:
    """Whether the main backward adds its dQ tiles with one bulk (TMA) reduce-add from shared
    memory instead of per-thread fp32 atomics. Hopper, head dims up to 128: measured on the H200
    (tools/bwd_variants.py, docs/perf.md v6) 19-23% off the main kernel on every problem."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_overlap(cfg: KernelConfig) -> bool:
    """Whether the main backward issues its S^T and dP^T products asynchronously back to back and
    computes P while the second runs (Hopper wgmma, head dims up to 128: 7-12% off on the H200)."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_ws(cfg: KernelConfig) -> bool:
    """Whether the main backward is ``bwd_ws.py``'s hand warp-specialized kernel: Hopper,
    precision="fast", head dims up to 128 (its 64x128 tiles). Measured on the H200
    (tools/bwd_variants.py, docs/perf.md v7) against TileLang's pipelined kernel with bulk dQ and async
    S/dP: 10-15% off the unsplit main kernel (golden 0.237 -> 0.213 ms, gpt-oss SWA 0.183 -> 0.155),
    7-14% off the split one (causal D128 N4096 1.95 -> 1.81 ms, D64 N8192 5.52 -> 4.77); since v10 it
    runs unsplit with its tiles longest first (causal D128 N4096: 1.62 ms, :func:`bwd_split`).

    Strict (two-term P and dS products, 8 wgmma per tile against fast's 5) at head dim 64 too: measured
    on the H200 (docs/perf.md v13) causal D64 N8192 main kernel 6.08 -> 5.33 ms against TileLang's
    pipelined strict kernel (longest first, branched). At D128 it loses (2.28 -> 2.41 ms: the two-term
    dS^T tiles leave shared memory for two ring slots only), so strict D128 and D256 keep TileLang's.

    Built and not measured yet (tools/bwd_variants.py rows, docs/perf.md v16): ``skip_halves`` (a
    consumer skips the row blocks its half of the keys cannot see) and ``prefetch`` (the next row
    block's S^T, and dP^T, issued before this block's softmax)."""
    if not cfg.hopper:
        return False
    if cfg.precision == "strict":
        return cfg.head_dim == cfg.head_dim_v == 64
    return max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_dq_first(cfg: KernelConfig) -> bool:
    """Whether the warp-specialized main backward issues each tile's dQ product before its dK product
    and hands dQ to the producer while dK's runs (FlashAttention-3's order; ``bwd_ws.build_bwd_ws``),
    with 128-row query tiles (:func:`bwd_tiles`): head dim 64. Measured on the H200
    (tools/bwd_variants.py, docs/perf.md v12): causal D64 N8192 main kernel 3.832 -> 3.662 ms (64-row
    tiles in the old order -> 128-row tiles dQ first; 128-row tiles in the old order were 3.958, 64-row
    tiles dQ first 4.278), gpt-oss SWA 0.162 -> 0.158. At D128 the order loses (64-row tiles 1.701 ->
    1.806 ms dQ first; 128-row tiles do not fit its registers), so D128 and D32 (not measured) keep
    64-row tiles in the old order. Causal padded layouts only: ptxas spills the 128-row kernel's
    registers for full (non-causal) attention (104 bytes) and packed batches (296 bytes), where the
    64-row kernel spills none."""
    return (bwd_ws(cfg) and cfg.precision == "fast" and cfg.head_dim == cfg.head_dim_v == 64 and cfg.causal
            and cfg.layout != "thd")


def bwd_ws_options(cfg: KernelConfig) -> dict:
    """The hand warp-specialized main backward's ``skip_halves`` and ``prefetch``
    (``bwd_ws.build_bwd_ws``) for the library's kernels: both off until measured (tools/bwd_variants.py's
    ".../skip" and ".../prefetch-*" rows, docs/perf.md v16). Turning one on is a change here; ``prefetch``
    waits for the next block's ring slot one block early, so it wants 3 stages in :func:`bwd_tiles`."""
    return {"skip_halves": False, "prefetch": ""}


#: whether :func:`bwd_dq_cast` answers yes where it can: off until the option is measured on the H200
#: (tools/bwd_variants.py's ".../dqcast" rows, docs/perf.md v17); turning it on is the whole switch
DQ_CAST = False


def bwd_dq_cast(cfg: KernelConfig) -> bool:
    """Whether the unsplit fast main backward casts dQ itself (``bwd_ws.build_bwd_ws(dq_cast=True)``:
    each row block's last add, counted, loads the finished fp32 rows back and writes dQ), so no
    postprocess runs after it (``dense._backward``; the split kernel keeps the postprocess).
    Where it can: the hand warp-specialized kernel, fast precision, padded layouts, not deterministic.
    Built, not measured yet (docs/perf.md v17: predicted golden -35..-45 us, gpt-oss SWA -15..-20 us of
    the backward): :data:`DQ_CAST` is off until tools/bwd_variants.py says it wins."""
    return (DQ_CAST and bwd_ws(cfg) and cfg.precision == "fast" and not cfg.deterministic
            and cfg.layout != "thd")


def bwd_branch(cfg: KernelConfig, ws: bool) -> bool:
    """Whether the main backward skips its per-element mask (two selects per element, P and dS)
    on wholly visible row blocks, as the forward's ``"branch"`` does: the hand warp-specialized
    kernel (``ws``), where the causal problems' tiles are mostly wholly visible. TileLang's
    pipelined kernel (strict, D256, sm_80) keeps the mask everywhere until measured
    (tools/bwd_variants.py times both, docs/perf.md v10). Measured since on the H200 for TileLang's
    strict kernel (docs/perf.md v11, causal, longest first from its grid): D128 N4096 2.558 -> 2.392 ms,
    D64 N8192 6.702 -> 6.043, dK/dV bitwise equal; so Hopper's strict kernel branches too (D256's
    fast split kernel and sm_80 keep the mask everywhere: not measured)."""
    return ws or (cfg.hopper and cfg.precision == "strict")


def bwd_swap(cfg: KernelConfig, ws: bool) -> bool:
    """Whether TileLang's main backward (strict, D256, sm_80: not ``ws``) issues its KV tiles longest
    first by laying its grid out as (KV heads, KV tiles) instead of (KV tiles, KV heads): the GPU hands
    out programs x fastest, so tile 0 (the causal tile every row sees) of every head goes first. Its
    CUDA is the launch-order kernel's with ``blockIdx.x`` and ``blockIdx.y`` exchanged; the same order
    by index arithmetic (``schedule.by_work``) misled TileLang 0.1.15's sync placement (docs/perf.md
    v10). Padded layouts only: a packed batch's KV tiles could pass the grid's y extent (65535)."""
    return not ws and cfg.layout != "thd"


def fwd_mask(cfg: KernelConfig) -> str:
    """How the pipelined forward masks its logits (``fwd.build_fwd_pipelined``'s ``mask``): ``"branch"``
    on Hopper, ``"select"`` elsewhere."""
    return "branch" if cfg.hopper else "select"


def fwd_ws(cfg: KernelConfig) -> bool:
    """Whether the forward is ``fwd_ws.py``'s hand warp-specialized kernel: Hopper, equal head dims 64
    or 128 (80 and 96 run padded to 128)."""
    return cfg.hopper and cfg.head_dim == cfg.head_dim_v and cfg.head_dim in (64, 128)


def pack_gqa_fits(cfg: KernelConfig, block_m: int) -> bool:
    """Whether ``fwd_ws.build_fwd_ws(pack_gqa=True)`` can pack a GQA group's query heads into one
    ``block_m``-row tile: head dims 64 and 128 (one TMA box per 64 columns), a group of at least two
    heads that divides ``block_m`` into whole 8-row swizzle atoms."""
    g = cfg.groups
    return cfg.head_dim in (64, 128) and g >= 2 and block_m % g == 0 and (block_m // g) % 8 == 0


#: the windowed kind's rows at head dim 64 (:func:`fwd_window_tiles`) where the group packs into them (perf-log
#: v28, v29); 192 restores the earlier kernels
FWD_WINDOW_ROWS_D64 = 256

#: the widest window that launches the forward's windowed tiles (the kind ``fwd_window``); wider windows
#: keep :func:`fwd_tiles`
WINDOW_TILES_MAX = 128


def fwd_window_tiles(cfg: KernelConfig) -> Tiles:
    """Forward tiles for a window of at most :data:`WINDOW_TILES_MAX` keys (the kind ``fwd_window``):
    64-key tiles, three K/V ring slots, the rows (:data:`FWD_WINDOW_ROWS_D64` or 192 at head dim 64, 128
    at 128) the first the GQA group packs into (:func:`pack_gqa_fits`); causal, and at head dim 128
    padded layouts only; elsewhere :func:`fwd_tiles`."""
    if fwd_ws(cfg) and cfg.causal and (cfg.head_dim == 64 or cfg.layout != "thd"):
        rows = dict.fromkeys([FWD_WINDOW_ROWS_D64, 192]) if cfg.head_dim == 64 else [128]
        for bm in rows:  # the first that the group packs into
            if pack_gqa_fits(cfg, bm):
                return Tiles(bm, 64, 2 * bm, 3)
    return fwd_tiles(cfg)


@functools.lru_cache(maxsize=None)
def fwd_windowed(cfg: KernelConfig) -> bool:
    """Whether a call with a window of at most :data:`WINDOW_TILES_MAX` keys launches ``fwd_window``:
    where its tiles differ from the forward's. (Cached: asked on every call.)"""
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
    """The windowed kind's epilogue: "tma" in padded layouts, "wg" in packed batches (a TMA box past one
    sequence's last row would write into the next sequence's)."""
    return "wg" if cfg.layout == "thd" else "tma"


def fwd_o32(cfg: KernelConfig) -> bool:
    """Whether strict's forward, when a backward follows, is the kind ``fwd_o32`` (two-term P @ V, the
    output also in fp32 for the kind ``preprocess_o32``'s Delta): strict, :func:`fwd_ws`, padded layouts.
    A call with ``scale <= 0`` and the torch.compile route keep the strict ``preprocess``."""
    return cfg.precision == "strict" and fwd_ws(cfg) and cfg.layout != "thd"


def fwd_o32_tiles(cfg: KernelConfig) -> Tiles:
    """``fwd_o32``'s tiles: two consumer warpgroups at both head dims (D64's three spill with P's second
    term)."""
    return Tiles(128, 128, 256, 2)


def fwd_fold(cfg: KernelConfig) -> bool:
    """Whether the forward folds the scale into the exponent's FMA, ``exp2(s * scale_log2 - m * scale_log2)``:
    :func:`fwd_ws`. Right for a positive scale only; a call with ``scale <= 0`` launches ``fwd_unfolded``."""
    return fwd_ws(cfg)


#: query heads of a GQA group per program in the split main backward: at most this many programs
#: share one (KV tile, KV head)
MAX_BWD_SPLIT = 8


def bwd_split(cfg: KernelConfig) -> int:
    """Programs per (KV tile, KV head) of the ``bwd_split`` kernel (``bwd.build_bwd``), each
    streaming ``groups / split`` query heads: the largest divisor of the group up to
    MAX_BWD_SPLIT. 1 (no split kernel) for groups of one head, strict and deterministic
    configurations (its dK/dV are fp32 atomics, so not bitwise reproducible; strict keeps dK/dV
    reproducible as before), head_dim != head_dim_v (one cast kernel), off Hopper (measured there
    only), and where the main backward is the hand warp-specialized kernel (``bwd_ws``): with its
    KV tiles issued longest first and the mask branch, the unsplit kernel is as fast as the split
    one and saves the fp32 dK/dV zeroing and casts (H200, causal bf16 D128 N4096 H64/8, main kernel
    1.62 ms unsplit against 1.61-1.77 split 8 ways, whole backward 1.72 against 1.77;
    tools/bwd_variants.py, docs/perf.md v10). The split kernel stays for D256 (TileLang's kernel)."""
    if cfg.deterministic or cfg.precision != "fast" or cfg.head_dim != cfg.head_dim_v or not cfg.hopper:
        return 1
    if bwd_ws(cfg):
        return 1
    return max(d for d in range(1, MAX_BWD_SPLIT + 1) if cfg.groups % d == 0)


#: the split main backward (head dim 256 since v10, :func:`bwd_split`) runs when the rows one KV
#: tile can see reach this many: measured on the H200 (docs/perf.md v6, TileLang's kernel at D64/D128),
#: full causal N=4096/8192 ran 1.5-1.6x faster split 8 ways, while window 128 ran 6-10% slower (few
#: rows per program: the fp32 dK/dV adds and casts dominate); not re-measured at D256
BWD_SPLIT_MIN_ROWS = 1024


def pre_branch(cfg: KernelConfig) -> bool:
    """Whether the strict preprocess (Delta from P and dP) computes P without the per-element mask on
    the KV tiles wholly visible to its query tile, as the forward's ``"branch"``: Hopper. Measured on
    the H200 (tools/bwd_variants.py, docs/perf.md v12) with :func:`pre_lpt`: causal D128 N4096 0.609 ->
    0.549 ms, causal D64 N8192 1.624 -> 1.432 (branch alone 0.573 / 1.485), Delta bitwise equal."""
    return cfg.hopper and cfg.precision == "strict"


def pre_lpt(cfg: KernelConfig) -> bool:
    """Whether the strict preprocess issues its causal query tiles with the most keys first, from its
    grid's layout (heads along x, query tiles along y counted from the last; ``schedule.grid_dims``):
    with :func:`pre_branch`, padded layouts (a packed batch's tiles could pass the grid's y extent)."""
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
    """``preprocess_o32``'s tiles: the fast preprocess's (the same memory-bound pass over an fp32 O)."""
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
    """Split-KV forward (decode): one packed row tile, keys streaming through."""
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
