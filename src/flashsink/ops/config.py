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
#: head dims with attention_kvcache kernels (ops/kvcache.py: the cache is never padded, that would copy it
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
    """Rows of a packed batch's statistics (``interface._stat_shape`` for ``thd``): whole row tiles of
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
    """Forward tiles. Hopper numbers follow TileLang's measured 128x128/256-thread
    configuration (492 TFLOP/s, bf16 D=128 causal, H200, see TILELANG-NOTES);
    wider key tiles for D<=64 halve the number of softmax rescales."""
    d = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.hopper:
        if d <= 64:
            # the warp-specialized kernel (fwd_ws): three consumer warpgroups of 64 rows, measured
            # 1.11x over two on causal D64 N8192 (docs/perf-log.md v9); ``threads`` is its consumers'
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
    (tools/bwd_variants.py, docs/perf-log.md v6) 19-23% off the main kernel on every problem."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_overlap(cfg: KernelConfig) -> bool:
    """Whether the main backward issues its S^T and dP^T products asynchronously back to back and
    computes P while the second runs (Hopper wgmma, head dims up to 128: 7-12% off on the H200)."""
    return cfg.hopper and max(cfg.head_dim, cfg.head_dim_v) <= 128


def bwd_ws(cfg: KernelConfig) -> bool:
    """Whether the main backward is ``bwd_ws.py``'s hand warp-specialized kernel: Hopper,
    precision="fast", head dims up to 128 (its 64x128 tiles). Measured on the H200
    (tools/bwd_variants.py, docs/perf-log.md v7) against TileLang's pipelined kernel with bulk dQ and async
    S/dP: 10-15% off the unsplit main kernel (golden 0.237 -> 0.213 ms, gpt-oss SWA 0.183 -> 0.155),
    7-14% off the split one (causal D128 N4096 1.95 -> 1.81 ms, D64 N8192 5.52 -> 4.77); since v10 it
    runs unsplit with its tiles longest first (causal D128 N4096: 1.62 ms, :func:`bwd_split`).

    Strict (two-term P and dS products, 8 wgmma per tile against fast's 5) at head dim 64 too: measured
    on the H200 (docs/perf-log.md v13) causal D64 N8192 main kernel 6.08 -> 5.33 ms against TileLang's
    pipelined strict kernel (longest first, branched). At D128 it loses (2.28 -> 2.41 ms: the two-term
    dS^T tiles leave shared memory for two ring slots only), so strict D128 and D256 keep TileLang's.

    Built and not measured yet (tools/bwd_variants.py rows, docs/perf-log.md v16): ``skip_halves`` (a
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
    (tools/bwd_variants.py, docs/perf-log.md v12): causal D64 N8192 main kernel 3.832 -> 3.662 ms (64-row
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
    ".../skip" and ".../prefetch-*" rows, docs/perf-log.md v16). Turning one on is a change here; ``prefetch``
    waits for the next block's ring slot one block early, so it wants 3 stages in :func:`bwd_tiles`."""
    return {"skip_halves": False, "prefetch": ""}


#: whether :func:`bwd_dq_cast` answers yes where it can: off until the option is measured on the H200
#: (tools/bwd_variants.py's ".../dqcast" rows, docs/perf-log.md v17); turning it on is the whole switch
DQ_CAST = False


def bwd_dq_cast(cfg: KernelConfig) -> bool:
    """Whether the unsplit fast main backward casts dQ itself (``bwd_ws.build_bwd_ws(dq_cast=True)``:
    each row block's last add, counted, loads the finished fp32 rows back and writes dQ), so no
    postprocess runs after it (``interface._backward``; the split kernel keeps the postprocess).
    Where it can: the hand warp-specialized kernel, fast precision, padded layouts, not deterministic.
    Built, not measured yet (docs/perf-log.md v17: predicted golden -35..-45 us, gpt-oss SWA -15..-20 us of
    the backward): :data:`DQ_CAST` is off until tools/bwd_variants.py says it wins."""
    return (DQ_CAST and bwd_ws(cfg) and cfg.precision == "fast" and not cfg.deterministic
            and cfg.layout != "thd")


def bwd_branch(cfg: KernelConfig, ws: bool) -> bool:
    """Whether the main backward skips its per-element mask (two selects per element, P and dS)
    on wholly visible row blocks, as the forward's ``"branch"`` does: the hand warp-specialized
    kernel (``ws``), where the causal problems' tiles are mostly wholly visible. TileLang's
    pipelined kernel (strict, D256, sm_80) keeps the mask everywhere until measured
    (tools/bwd_variants.py times both, docs/perf-log.md v10). Measured since on the H200 for TileLang's
    strict kernel (docs/perf-log.md v11, causal, longest first from its grid): D128 N4096 2.558 -> 2.392 ms,
    D64 N8192 6.702 -> 6.043, dK/dV bitwise equal; so Hopper's strict kernel branches too (D256's
    fast split kernel and sm_80 keep the mask everywhere: not measured)."""
    return ws or (cfg.hopper and cfg.precision == "strict")


def bwd_swap(cfg: KernelConfig, ws: bool) -> bool:
    """Whether TileLang's main backward (strict, D256, sm_80: not ``ws``) issues its KV tiles longest
    first by laying its grid out as (KV heads, KV tiles) instead of (KV tiles, KV heads): the GPU hands
    out programs x fastest, so tile 0 (the causal tile every row sees) of every head goes first. Its
    CUDA is the launch-order kernel's with ``blockIdx.x`` and ``blockIdx.y`` exchanged; the same order
    by index arithmetic (``schedule.by_work``) misled TileLang 0.1.15's sync placement (docs/perf-log.md
    v10). Padded layouts only: a packed batch's KV tiles could pass the grid's y extent (65535)."""
    return not ws and cfg.layout != "thd"


def fwd_mask(cfg: KernelConfig) -> str:
    """How the forward masks its logits (``fwd.build_fwd``'s ``mask``): on Hopper ``"branch"``,
    which skips the per-element select on wholly visible KV tiles, measured on the H200
    (tools/fwd_variants.py, docs/perf-log.md v7) 1.17x on causal D128 N4096 and 1.37x on causal D64
    N8192, 3-4% slower with a 128-token window (the branch costs more than the select it saves
    when every tile touches the window's edge); bitwise the same o and lse. The window is a runtime
    value, so one kernel serves both. ``"select"`` elsewhere (not measured off Hopper)."""
    return "branch" if cfg.hopper else "select"


def fwd_ws(cfg: KernelConfig) -> bool:
    """Whether the forward is ``fwd_ws.py``'s hand warp-specialized kernel (FlashAttention-3's
    intra-warpgroup overlap and scheduler barriers, a persistent grid): Hopper, head dims 64 and 128
    (the kernels' own; 80 and 96 run padded to 128). Measured on the H200 (tools/fwd_variants.py,
    docs/perf-log.md v9) against the pipelined kernel with mask="branch": causal D128 N4096 0.583 ->
    0.538 ms, causal D64 N8192 1.500 -> 1.347 (192-row tiles), golden 0.158 -> 0.130, gpt-oss SWA
    0.116 -> 0.108 (128-row tiles; 0.121 with the 192-row tiles D64 uses); o and lse bitwise equal.
    Only equal head dims for q/k and v: those are the ones measured and checked on the GPU (a
    separate head dim of v, e.g. 128/64, keeps the pipelined kernel until it is)."""
    return cfg.hopper and cfg.head_dim == cfg.head_dim_v and cfg.head_dim in (64, 128)


def pack_gqa_fits(cfg: KernelConfig, block_m: int) -> bool:
    """Whether ``fwd_ws.build_fwd_ws(pack_gqa=True)`` can pack a GQA group's query heads into one
    ``block_m``-row tile: head dims 64 and 128 (a head's rows are one TMA box per 64 columns), a group of
    at least two heads that divides ``block_m`` into whole 8-row swizzle atoms (at gpt-oss's 192 rows:
    groups 2, 3, 4, 6, 8, 12, 24). The library packs at head dim 64, and at 128 under a window (the kind
    ``fwd_window``: :func:`fwd_ws_options`, :func:`fwd_window_tiles`)."""
    g = cfg.groups
    return cfg.head_dim in (64, 128) and g >= 2 and block_m % g == 0 and (block_m // g) % 8 == 0


#: the windowed kind's rows at head dim 64 (:func:`fwd_window_tiles`): 256 (four consumer warpgroups, where the
#: group packs into them; else 192) measured 12-14% faster than 192 on an H100 (tools/fwd_variants.py, docs/perf-log.md
#: v28: gpt-oss SWA 0.0638 -> 0.0563 ms, varlen W128 0.5171 -> 0.4446), o and lse off the tool's reference by the
#: same amounts; the default since docs/perf-log.md v29 (the GPU suite ran with it). 192 restores the earlier kernels.
FWD_WINDOW_ROWS_D64 = 256

#: the widest window that launches the forward's windowed tiles (the kind ``fwd_window``,
#: :func:`fwd_window_tiles`): the window measured (gpt-oss's 128); wider windows keep :func:`fwd_tiles`
WINDOW_TILES_MAX = 128


def fwd_window_tiles(cfg: KernelConfig) -> Tiles:
    """Forward tiles for a window of at most :data:`WINDOW_TILES_MAX` keys (the kind ``fwd_window``):
    64-key tiles, three K/V ring slots, a GQA group packed into the tile (:func:`fwd_ws_options` with
    ``window=True``), where the group packs (:func:`pack_gqa_fits`); elsewhere :func:`fwd_tiles`.
    A packed tile of P positions sees W + P - 1 keys: at W=128, 24 positions (D64's 192 rows, 8 heads)
    see 151 keys, 3-4 tiles of 64 (~215 keys a row computed) against 2-3 of 128 (~282); 16 positions
    (D128's 128 rows) see 143, ~205 keys against 256. Measured on the H200 in one run
    (tools/fwd_variants.py, docs/perf-log.md v19): gpt-oss SWA (bf16 D64 W128 N4096 H64/8) 0.0936 -> 0.0787 ms
    (FA4 0.0827), golden (fp16 D128 W128) 0.1238 -> 0.1102 (FA4 0.1181), varlen W128 (64 sequences,
    32768 tokens, thd) 0.6697 -> 0.6174; o within one rounding of the forward's (the key tiles split the
    sums differently: relative L2 1.2e-3 bf16, 1.5e-4 fp16; lse 3e-8). Slower on full causal attention
    (causal D64 N8192 1.2506 -> 1.4997: four times the softmax passes of 128-key tiles), hence a kind of
    its own chosen by the call's window (a runtime value). Causal configurations only (a window needs
    the causal mask); at head dim 128 padded layouts only (ptxas sm_90a: the packed thd kernel spills
    76 bytes of registers, the bhsd one 8, D64's none; not measured on the GPU).

    Head dim 64's rows: :data:`FWD_WINDOW_ROWS_D64` where the group packs into them, else 192. At 256 rows
    (four consumer warpgroups, 32 positions of 8 heads) W=128 spans always 3 tiles of 64 (24 positions: 3-4)
    and a row tile's fixed cost (docs/perf-log.md v24: 4.06 us against 1.05 us a KV tile) is shared by a third
    more rows; ptxas sm_90a compiles it at the launch bound's 96 registers a thread (the consumers'
    setmaxnreg is 112), no spills."""
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


#: ``fwd_ws.build_fwd_ws``'s ``pin_wait`` in every forward kind of that kernel (fwd, fwd_unfolded, fwd_window,
#: fwd_o32): the wait for each tile's P V product kept after its softmax by a shared-memory store. Without it
#: ptxas (CUDA 13.0, sm_90a) hoists that wait above the row maximum and the exponentials (cuobjdump -sass,
#: docs/perf-log.md v20). **Off**: measured on the H200 in one run (tools/fwd_variants.py, docs/perf-log.md v21) it
#: lost where it was predicted to win: causal D64 N8192 1.2635 -> 1.3289 ms (+5.2%), golden's windowed
#: kind 0.1100 -> 0.1138 (+3.5%), gpt-oss SWA's 0.0779 -> 0.0791, causal D128 N4096 0.5168 -> 0.5107
#: (-1.2%, inside that run's spread); o and lse bitwise the same.
FWD_PIN_WAIT = False
#: ``fwd_ws.build_fwd_ws``'s ``mask_limits`` in the same kinds: a masked tile's logits compared with each row's
#: key limits, worked out once per row (``mask.limit_logits``), instead of the visibility test per element; the
#: same slots masked. SASS of gpt-oss SWA's windowed kernel (docs/perf-log.md v20): the main loop's instructions
#: between the two waits 345 -> 305. Measured on the H200 (docs/perf-log.md v21, o and lse bitwise the same):
#: golden's windowed kind 0.1100 -> 0.1071 ms (-2.6%), gpt-oss SWA's 0.0779 -> 0.0763 (-2.1%), causal D64
#: N8192 1.2635 -> 1.2554, causal D128 N4096 0.5168 -> 0.5196 (both inside the run's spread).
FWD_MASK_LIMITS = True


def fwd_ws_options(cfg: KernelConfig, tiles: Tiles | None = None, window: bool = False) -> dict:
    """``fwd_ws.build_fwd_ws``'s ``epilogue``, ``q_slots`` and ``pack_gqa`` for the forward (the kinds
    ``fwd`` and ``fwd_unfolded``; strict's ``fwd_o32`` keeps the defaults), for ``tiles`` (default
    :func:`fwd_tiles`). Head dim 64: ``epilogue="regs"`` (o stored from each thread's registers, no
    barrier of every consumer thread at a tile's end) and ``q_slots=2`` (the next query tile's Q loads
    while this one computes). Measured on the H200 in one run (tools/fwd_variants.py, docs/perf-log.md
    v15), 192x128 tiles, o and lse bitwise equal to the previous kernel: gpt-oss SWA (bf16 D64 W128
    N4096 H64/8) 0.1207 -> 0.1027 ms, also under the 0.1052 of the 128-row tiles that windows up to 128
    keys ran until then (v12-v14's ``fwd_window``, removed then; the kind is back since v19 with packed
    64-key tiles, :func:`fwd_window_tiles`); causal D64 N8192 1.3016 -> 1.2776. Head dim 128 keeps the staged epilogue and one Q slot:
    there both options measured slower (golden 0.1236 -> 0.1402 with "regs", 0.1250 with two slots;
    causal D128 N4096 0.5105 -> 0.5141 .. 0.5317).

    ``pack_gqa`` (a GQA group's query heads in one tile, so one K/V tile serves the group and a tile
    spans fewer positions: fewer KV tiles under a window, fewer wasted rows at a short sequence's
    end) at head dim 64 where :func:`pack_gqa_fits`. Head dim 128 packs under a window only (the kind
    ``fwd_window``): at its forward's 128x128 tiles packing measured no gain (golden 0.1238 -> 0.1257
    ms, docs/perf-log.md v19; 16 positions still span 2 KV tiles, only the K/V loads per group fall), nor on
    causal D128 N4096, where FlashAttention-4 packs (0.4962 -> 0.5071 ms, v23, H100, one run).
    Measured on the H200 in one run (tools/fwd_variants.py, docs/perf-log.md v18), 192x128 tiles, o and lse bitwise equal to the unpacked kernel: gpt-oss SWA
    0.1039 -> 0.0938 ms, varlen W128 (64 sequences, 32768 tokens) 0.9331 -> 0.6736, varlen full
    1.3530 -> 0.9929, causal D64 N8192 1.2584 -> 1.2605 (the same within noise).

    ``window``: the options of the kind ``fwd_window`` (:func:`fwd_window_tiles`): head dim 64's as
    above; at 128 packed, with two Q slots; at both the epilogue "tma" in padded layouts and "wg" in packed
    batches (below). Two slots lost with "regs" (golden 0.1102
    against 0.1181 ms, docs/perf-log.md v19) but win with "wg", which stages o in a buffer of its own: golden
    0.0951 -> 0.0884 and 0.0945 -> 0.0880 ms in two runs on an H100 (tools/fwd_variants.py, docs/perf-log.md
    v26), o and lse off the tool's reference kernel by the same amounts (the arithmetic is unchanged: the
    second slot only lets the producer load the next tile's Q while this one computes).

    ``epilogue="wg"`` (each consumer warpgroup stages its own rows and stores them 16 bytes a thread,
    ``fwd_ws.build_fwd_ws``) in the kind ``fwd_window`` at head dims 64 and 128 and in every head dim 128
    forward. Measured on an H100 in one run (tools/fwd_variants.py, docs/perf-log.md v24), o and lse bitwise
    the same as the epilogue it replaces: gpt-oss SWA's windowed kernel 0.0783 -> 0.0659 ms (from "regs"),
    golden's 0.1107 -> 0.0956 (from "smem"), golden on the 128x128 tiles of windows over 128 keys 0.1219 ->
    0.1101, causal D128 N4096 0.4863 -> 0.4852 (the same). Causal D64 N8192 keeps "regs": 1.2370 -> 1.2645
    with "wg". ``q_ahead`` (the next tile's Q before this tile's K and V) stays off: SWA 0.0659 -> 0.0717 with
    it, causal D64 1.2370 -> 1.2770 (three Q slots: 0.0671, 1.2265).

    ``epilogue="tma"`` ("wg"'s staged rows stored by TMA from one thread of each consumer warpgroup, 8-row
    boxes, ``fwd_ws.build_fwd_ws``; padded layouts only) measured faster in the kind ``fwd_window`` on the
    H200 in one run (tools/fwd_variants.py, docs/perf-log.md v27), o and lse off the tool's reference by the
    same amounts as "wg"'s: golden 0.0863 -> 0.0833 ms, gpt-oss SWA 0.0649 -> 0.0644 (a tie), so it is
    the kind ``fwd_window``'s epilogue in padded layouts (docs/perf-log.md v28); packed batches keep "wg" (a
    TMA box past one sequence's last row would write into the next sequence's rows).

    ``pin_wait`` and ``mask_limits``: :data:`FWD_PIN_WAIT` and :data:`FWD_MASK_LIMITS` everywhere.

    ``wg_ranges`` stays off: measured slower everywhere but under a window with 64-key tiles (gpt-oss
    SWA 0.1039 -> 0.0911 at 192x64, behind ``pack_gqa``'s 0.0938 only by 3%; causal D64 N8192 1.26 ->
    2.10, golden 0.1250 -> 0.1461), and it cannot combine with ``pack_gqa``."""
    both = {"pin_wait": FWD_PIN_WAIT, "mask_limits": FWD_MASK_LIMITS}
    if fwd_ws(cfg) and cfg.head_dim == 64:
        bm = (tiles or fwd_tiles(cfg)).block_m
        epilogue = _window_epilogue(cfg) if window and fwd_windowed(cfg) else "regs"
        return {"epilogue": epilogue, "q_slots": 2, "pack_gqa": pack_gqa_fits(cfg, bm), **both}
    epilogue = "wg" if fwd_ws(cfg) and cfg.head_dim == 128 else "smem"
    if window and fwd_windowed(cfg):  # head dim 128's windowed tiles pack (fwd_window_tiles)
        epilogue = _window_epilogue(cfg) if epilogue == "wg" else epilogue
        return {"epilogue": epilogue, "q_slots": 1 if epilogue == "smem" else 2, "pack_gqa": True, **both}
    return {"epilogue": epilogue, "q_slots": 1, **both}


def _window_epilogue(cfg: KernelConfig) -> str:
    """The windowed kind's epilogue: "tma" in padded layouts, "wg" in packed batches (a TMA box past one
    sequence's last row would write into the next sequence's; ``fwd_ws.build_fwd_ws``)."""
    return "wg" if cfg.layout == "thd" else "tma"


def fwd_o32(cfg: KernelConfig) -> bool:
    """Whether strict's forward, when a backward follows, is the kind ``fwd_o32``: ``fwd_ws.py``'s kernel
    with P @ V as two-term products and the output also written in fp32, from which the backward
    takes Delta = rowsum(dO * O) in a memory-bound pass (the kind ``preprocess_o32``) instead of
    recomputing P and dP (the strict ``preprocess``). Measured on the H200 (tools/fwd_variants.py,
    tools/bwd_variants.py, docs/perf-log.md v13): the forward 0.513 -> 0.721 ms at causal D128 N4096 and
    1.259 -> 1.798 at causal D64 N8192, the preprocess 0.541 -> 0.060 and 1.450 -> 0.060: strict
    fwd+bwd 3.47 -> 3.20 ms and 8.12 -> 7.27. Float64 emulation (docs/perf-log.md v13): Delta from a
    once-rounded P's fp32 O moves dsink off the precision standard in fp16 (relative L2 1.7e-3);
    with two terms its error is 1e-7..3e-6, as with P * dP. Hopper, the warp-specialized forward's
    head dims, padded layouts (a packed batch's kernel is not checked for spills yet); a call with
    ``scale <= 0`` (no folded kernel) and the torch.compile route keep P * dP."""
    return cfg.precision == "strict" and fwd_ws(cfg) and cfg.layout != "thd"


def fwd_o32_tiles(cfg: KernelConfig) -> Tiles:
    """``fwd_o32``'s tiles: two consumer warpgroups at both head dims (D64's three spill 272 bytes of
    registers with P's second term)."""
    return Tiles(128, 128, 256, 2)


def fwd_fold(cfg: KernelConfig) -> bool:
    """Whether the forward (``fwd_ws.py``'s kernel) folds the scale into the exponent's FMA,
    ``exp2(s * scale_log2 - m * scale_log2)``, instead of scaling every logit first: measured on the
    H200 (tools/fwd_variants.py, docs/perf-log.md v10-v11) causal D128 N4096 0.5295 -> 0.5116 ms (128x128
    tiles), causal D64 N8192 1.3324 -> 1.2812 (192x128); o within one rounding of the unfolded
    kernel's (relative L2 3.7e-5), lse 1.4e-8. The running maximum is then over the unscaled logits,
    which is right for a positive scale only: a call with ``scale <= 0`` launches the kind
    ``fwd_unfolded`` (the same kernel without the fold, built on its first such call)."""
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
    tools/bwd_variants.py, docs/perf-log.md v10). The split kernel stays for D256 (TileLang's kernel)."""
    if cfg.deterministic or cfg.precision != "fast" or cfg.head_dim != cfg.head_dim_v or not cfg.hopper:
        return 1
    if bwd_ws(cfg):
        return 1
    return max(d for d in range(1, MAX_BWD_SPLIT + 1) if cfg.groups % d == 0)


#: the split main backward (head dim 256 since v10, :func:`bwd_split`) runs when the rows one KV
#: tile can see reach this many: measured on the H200 (docs/perf-log.md v6, TileLang's kernel at D64/D128),
#: full causal N=4096/8192 ran 1.5-1.6x faster split 8 ways, while window 128 ran 6-10% slower (few
#: rows per program: the fp32 dK/dV adds and casts dominate); not re-measured at D256
BWD_SPLIT_MIN_ROWS = 1024


def pre_branch(cfg: KernelConfig) -> bool:
    """Whether the strict preprocess (Delta from P and dP) computes P without the per-element mask on
    the KV tiles wholly visible to its query tile, as the forward's ``"branch"``: Hopper. Measured on
    the H200 (tools/bwd_variants.py, docs/perf-log.md v12) with :func:`pre_lpt`: causal D128 N4096 0.609 ->
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
