"""The registry of kernel kinds: one row per kernel, read by everything that lists, selects or builds
kernels (first use, ``flashsink precompile``, the disk cache's key, :func:`forward_kind`, the tests).

A row is the kernel's builder (:func:`builders`), tile function (part of the disk-cache key), the
configurations that launch it and those it builds for, its route (a first launch builds its route's
kernels) and the configuration fields its code never reads (one build serves every value of them).
Adding one: docs/architecture.md, "Adding a kernel kind".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ...kernel_config import (
    WINDOW_TILES_MAX, KVCACHE_HEAD_DIMS, SPLIT_ROWS, KernelConfig, bwd_split, bwd_tiles, dq_tiles, fwd_fold, fwd_o32,
    fwd_o32_tiles, fwd_tiles, fwd_window_tiles, fwd_windowed, pre_o32_tiles, pre_tiles, split_tiles,
)


def _always(cfg: KernelConfig) -> bool:
    return True


def _split_kernel(cfg: KernelConfig) -> bool:
    # Hopper (sm_80's code generator rejects the split-KV forward), padded layouts (varlen never splits)
    return cfg.hopper and cfg.layout != "thd"


def _split_kv(cfg: KernelConfig) -> bool:
    # decode.use_split's static part: padded layouts on Hopper whose GQA group fits a packed tile
    return _split_kernel(cfg) and cfg.groups <= SPLIT_ROWS


def _has_split(cfg: KernelConfig) -> bool:
    return bwd_split(cfg) > 1


def _postprocess(cfg: KernelConfig) -> bool:
    # the fp32 accumulators' cast: after the atomic main backwards
    return not cfg.deterministic


def _kvcache(cfg: KernelConfig) -> bool:
    """Configurations ``attention_kvcache`` runs with: causal bshd, its head dims, not deterministic."""
    return (cfg.layout == "bshd" and cfg.causal and not cfg.deterministic and cfg.head_dim in KVCACHE_HEAD_DIMS
            and cfg.head_dim_v in KVCACHE_HEAD_DIMS)


def _never(cfg: KernelConfig) -> bool:
    return False


def _unfolded_call(cfg: KernelConfig, window: int, scale: float) -> bool:
    # the fold takes the running maximum over unscaled logits: right for a positive scale only
    return scale <= 0 and fwd_fold(cfg)


def _window_call(cfg: KernelConfig, window: int, scale: float) -> bool:
    return window <= WINDOW_TILES_MAX and fwd_windowed(cfg)


@dataclasses.dataclass(frozen=True)
class Kind:
    builder: Optional[Callable]  # KernelConfig -> PrimFunc; None: the kernels' own (:func:`builders`)
    tiles: Optional[Callable]  # the kernel_config tile function, or None (fixed blocks)
    needed: Callable[[KernelConfig], bool]  # does a configuration's forward + backward launch it?
    ignores: tuple = ()  # KernelConfig fields the kernel's code does not read
    #: does it build for a configuration at all (``flashsink precompile --kinds`` refuses the others)?
    builds: Callable[[KernelConfig], bool] = _always
    #: "dense" (attention's forward and backward) or "decode" (few query rows against a long cache): a
    #: first use builds its own route's kernels only (:func:`first_use_kinds`)
    route: str = "dense"
    #: about how many seconds one build takes (lab/compile_time.py): parallel builds start the longest first
    build_s: float = 5.0
    #: a forward the dense route launches instead of "fwd" where ``(cfg, window, scale) -> bool`` says so
    #: (asked in the registry's order by :func:`forward_kind`)
    chosen_when: Optional[Callable] = None
    #: configurations ``flashsink precompile`` builds it for beyond :attr:`needed` (attention_kvcache's)
    precompiled_when: Optional[Callable[[KernelConfig], bool]] = None


#: every kernel, in the order listed to users (``flashsink precompile --kinds``)
KINDS: dict = {
    "fwd": Kind(None, fwd_tiles, _always, ignores=("deterministic", "precision"), build_s=16.0),
    # the forward without the scale folded into its exponent, where "fwd" folds it (config.fwd_fold):
    # launched by a call with scale <= 0 only, so built on the first such call, not ahead
    "fwd_unfolded": Kind(None, fwd_tiles, _never, ignores=("deterministic", "precision"),
                         builds=fwd_fold, build_s=16.0, chosen_when=_unfolded_call),
    # the forward with a narrow window's tiles (config.fwd_window_tiles: 64-key tiles, a GQA group packed),
    # where they differ from "fwd"'s: launched by calls with window <= config.WINDOW_TILES_MAX (gpt-oss's
    # sliding layers share their configuration with the full ones, so a first use builds both forwards)
    "fwd_window": Kind(None, fwd_window_tiles, fwd_windowed, ignores=("deterministic", "precision"),
                       builds=fwd_windowed, build_s=16.0, chosen_when=_window_call),
    # strict's forward when a backward follows, and that backward's Delta pass (config.fwd_o32): two-term
    # P @ V and the output in fp32 too, read by a memory-bound Delta instead of recomputing P and dP
    "fwd_o32": Kind(None, fwd_o32_tiles, fwd_o32, ignores=("deterministic",), builds=fwd_o32,
                    build_s=16.0),
    "preprocess": Kind(None, pre_tiles, _always, build_s=5.0),
    "preprocess_o32": Kind(None, pre_o32_tiles, fwd_o32, builds=fwd_o32, build_s=5.0),
    "bwd": Kind(None, bwd_tiles, _always, build_s=8.0),
    "bwd_split": Kind(None, bwd_tiles, _has_split, builds=_has_split, build_s=8.0),
    "dq": Kind(None, dq_tiles, lambda cfg: cfg.deterministic, build_s=6.0),
    "postprocess": Kind(None, None, _postprocess,
                        ignores=("deterministic", "precision"), build_s=2.5),
    "fwd_split": Kind(None, split_tiles, _split_kv, ignores=("deterministic", "precision"),
                      route="decode", builds=_split_kernel, build_s=16.0),
    "fwd_kvcache": Kind(None, split_tiles, _never, ignores=("deterministic", "precision"),
                        route="decode", build_s=20.0, precompiled_when=_kvcache),
    # merges the split-KV partials (decode through attention, and attention_kvcache)
    "merge_splits": Kind(None, None, _split_kv, ignores=("deterministic", "precision"),
                         route="decode", build_s=2.5, precompiled_when=_kvcache),
}


def builders() -> dict:
    """The builders in ``ops/kernels`` of the rows that name none, imported when a kernel is built: the
    kernels import tilelang, and importing flashsink must not."""
    from ..kernels import bwd, fwd, fwd_kvcache, fwd_split, merge_splits

    return {
        "fwd": fwd.build_fwd, "fwd_unfolded": fwd.build_fwd_unfolded, "fwd_window": fwd.build_fwd_window,
        "fwd_o32": fwd.build_fwd_o32, "preprocess": bwd.build_preprocess, "preprocess_o32": bwd.build_preprocess_o32,
        "bwd": bwd.build_bwd, "bwd_split": bwd.build_bwd_split, "dq": bwd.build_dq, "postprocess": bwd.build_postprocess,
        "fwd_split": fwd_split.build_fwd_split, "fwd_kvcache": fwd_kvcache.build_fwd_kvcache,
        "merge_splits": merge_splits.build_merge_splits,
    }


def builder(name: str) -> Callable:
    """Kind ``name``'s builder: its row's, else :func:`builders`'."""
    return check_kind(name).builder or builders()[name]


#: the value a kind's ignored field takes in the configuration it is built and cached for (:func:`canonical`);
#: these values keep the disk-cache keys of earlier releases
CANONICAL = {"deterministic": False, "precision": "strict"}
#: the forward the dense route launches unless a row's ``chosen_when`` takes the call
DEFAULT_FORWARD = "fwd"


def kinds_for(cfg: KernelConfig) -> tuple:
    """The kernels one configuration's forward and backward launch."""
    return tuple(name for name, kind in KINDS.items() if kind.needed(cfg))


def first_use_kinds(name: str, cfg: KernelConfig) -> tuple:
    """What the first launch of kernel ``name`` for ``cfg`` builds, in parallel: ``name`` and the other
    kernels of :func:`kinds_for` on its route. A training step never launches the split-KV decode pair,
    the slowest to compile (~23 s on the H200's host, perf-log v9), so it does not wait for it."""
    route = KINDS[name].route
    return tuple(dict.fromkeys((name, *(k for k in kinds_for(cfg) if KINDS[k].route == route))))


def longest_first(names) -> list:
    """``names`` by :attr:`Kind.build_s`, longest first (ties keep their order): the order a parallel
    build starts them in, so that none of the longest is left for last."""
    return sorted(names, key=lambda name: -KINDS[name].build_s)


def precompile_kinds(cfg: KernelConfig) -> tuple:
    """What ``flashsink precompile`` builds for ``cfg``: :func:`kinds_for`, and attention_kvcache's
    kernels where that configuration serves it."""
    extra = tuple(name for name, kind in KINDS.items() if kind.precompiled_when and kind.precompiled_when(cfg))
    return tuple(dict.fromkeys(kinds_for(cfg) + extra))


def forward_kind(cfg: KernelConfig, window: int, scale: float) -> str:
    """The forward kernel a call launches (strict's fp32-output training forward aside): the first row
    whose ``chosen_when`` takes ``(cfg, window, scale)``, else :data:`DEFAULT_FORWARD`."""
    for name, kind in KINDS.items():
        if kind.chosen_when is not None and kind.chosen_when(cfg, window, scale):
            return name
    return DEFAULT_FORWARD


def forward_kinds() -> tuple:
    """The forwards :func:`forward_kind` chooses from (one launch protocol: ``fwd_entry``'s signature)."""
    return (DEFAULT_FORWARD, *(name for name, kind in KINDS.items() if kind.chosen_when is not None))


def route_kinds(route: str) -> tuple:
    """The kinds of one route ("dense" or "decode")."""
    return tuple(name for name, kind in KINDS.items() if kind.route == route)


def kvcache_kinds() -> tuple:
    """The kinds ``attention_kvcache`` launches (those precompiled beyond a forward and backward)."""
    return tuple(name for name, kind in KINDS.items() if kind.precompiled_when is not None)


def canonical(name: str, cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with the fields kernel ``name`` does not read at :data:`CANONICAL`'s values: the
    configuration it is built (and cached on disk) for."""
    ignored = {f: CANONICAL[f] for f in KINDS[name].ignores if getattr(cfg, f) != CANONICAL[f]}
    return dataclasses.replace(cfg, **ignored) if ignored else cfg


def check_kind(name: str) -> Kind:
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"kind must be one of {tuple(KINDS)}, got {name!r}")
    return kind
