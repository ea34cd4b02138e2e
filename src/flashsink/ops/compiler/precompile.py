"""``flashsink precompile``: many kernels compiled ahead of time, in parallel processes, into the disk
cache, so later processes load them. A kernel already cached is loaded and counted as cached. No GPU
needed: the architecture is part of each ``KernelConfig``.
"""

import itertools
import os
import sys
import time

from ...kernel_config import HEAD_DIM_RULE, PRECISIONS, SUPPORTED_ARCHS, KernelConfig, kernel_head_dim
from . import diskcache
from .kinds import KINDS as _REGISTRY, canonical, kinds_for, precompile_kinds
from .registry import compile_parallel

__all__ = ["compile_parallel", "kinds_for", "precompile"]


def supported_kinds(cfg: KernelConfig) -> tuple:
    """Every kernel kind that builds for ``cfg`` (``kinds.Kind.builds``): the split-KV forward only on
    Hopper (sm_90a) for the padded layouts; the split main backward only where the configuration has
    a split (``config.bwd_split``); the unfolded forward only where the forward folds its scale
    (``config.fwd_fold``; elsewhere it is ``fwd``)."""
    return tuple(name for name, kind in _REGISTRY.items() if kind.builds(cfg))


def precompile(configs, *, kinds=None, jobs=None, out=sys.stderr, pairs=()) -> list:
    """Compile every (kind, config) pair (``kinds``, default all a config needs, of each config,
    plus the explicit ``(kind, config)`` ``pairs``); returns the failures (empty when all built)."""
    todo = []
    for cfg in dict.fromkeys(configs):
        for kind in kinds or precompile_kinds(cfg):
            todo.append((kind, cfg))
    for kind, _ in todo + list(pairs):
        if kind not in _REGISTRY:
            raise ValueError(f"unknown kernel kind {kind!r}; expected one of {tuple(_REGISTRY)}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be an int >= 1 or None (one per CPU), got {jobs!r}")
    # one build for configurations that differ only in fields a kernel does not read
    todo = list(dict.fromkeys((kind, canonical(kind, cfg)) for kind, cfg in todo + list(pairs)))
    # the longest builds first (``Kind.build_s``), so that none of them starts last and holds the
    # whole run up while the other workers sit idle
    todo.sort(key=lambda pair: -_REGISTRY[pair[0]].build_s)
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    root = diskcache.ensure_cache_dir()  # an unsafe directory fails here, once, not in every worker
    failures = []
    print(f"precompiling {len(todo)} kernels in {jobs} processes into {root} ...", file=out, flush=True)
    start = time.perf_counter()
    tally = {"compiled": 0, "cached": 0, "rebuilt": 0}
    if todo:
        # one line per kernel as it finishes: how many are done, the kernel's own build time and the time since
        # the start
        for n, (kind, cfg, secs, how, err) in enumerate(compile_parallel(todo, jobs=jobs), 1):
            status = f"ok ({how})" if err is None else "FAILED"
            print(f"[{n}/{len(todo)}] {kind:<11} {cfg.short():<60} {secs:6.1f} s {status:<15} "
                  f"(elapsed {time.perf_counter() - start:.0f} s)", file=out, flush=True)
            if err is None:
                tally[how] += 1
            else:
                failures.append((kind, cfg, err))
    print(
        f"precompile done in {time.perf_counter() - start:.0f} s: {tally['compiled']} compiled, "
        f"{tally['cached']} already cached, {tally['rebuilt']} rebuilt, {len(failures)} failed",
        file=out, flush=True,
    )
    for kind, cfg, err in failures:
        shown = err if len(err) <= 3000 else err[:400] + "\n...\n" + err[-2500:]
        print(f"  {kind} {cfg.short()}: {shown}", file=out, flush=True)
    return failures


# ----------------------------------------------------------------------------------------------
# `flashsink precompile`: fill the kernel cache ahead of time (a login node, CI, a Docker build)

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def configs_from_args(args) -> list:
    """Every KernelConfig the options ask for (the product of the option lists)."""
    for d in args.head_dim:
        if kernel_head_dim(d) is None:
            raise ValueError(f"--head-dim: {d} is not one of the kernels' head dims ({HEAD_DIM_RULE})")
    for g in args.groups:
        if g < 1:
            raise ValueError(f"--groups: {g} must be >= 1 (query heads per KV head)")
    sinks = {"yes": (True,), "no": (False,), "both": (True, False)}[args.sinks]
    causal = {"causal": (True,), "full": (False,), "both": (True, False)}[args.mask]
    det = (False, True) if args.deterministic else (False,)
    layouts = list(dict.fromkeys(list(args.layout) + (["thd"] if getattr(args, "varlen", False) else [])))
    out = [KernelConfig(arch=arch, dtype=_DTYPES[dtype], head_dim=d, head_dim_v=d, groups=g, causal=c, has_sinks=s,
                        layout=layout, deterministic=dt, precision=prec)
           for arch, dtype, d, g, layout, s, c, dt, prec in itertools.product(
               args.arch, args.dtype, dict.fromkeys(kernel_head_dim(d) for d in args.head_dim), args.groups, layouts,
               sinks, causal, det, dict.fromkeys(args.precision))]
    return list(dict.fromkeys(out))  # --groups 8 8 plans one configuration, as precompile builds one


def kinds_from_args(args, configs) -> tuple | None:
    """``--kinds`` without repeats, or None (each configuration's own); ValueError for a kind that does
    not build for one of the configurations (refused before any compile)."""
    if not args.kinds:
        return None
    kinds = tuple(dict.fromkeys(args.kinds))
    for cfg in configs:
        bad = [k for k in kinds if k not in supported_kinds(cfg)]
        if bad:
            raise ValueError(
                f"--kinds {' '.join(bad)}: not built for {cfg.short()} (the split-KV forward is sm_90a-only, "
                f"padded layouts); {cfg.arch} {cfg.layout} configurations take {' '.join(supported_kinds(cfg))}"
            )
    return kinds


def cmd_precompile(args) -> int:
    try:
        configs = configs_from_args(args)
        kinds = kinds_from_args(args, configs)
    except ValueError as exc:
        print(f"flashsink precompile: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cfg in configs:
            print(f"{cfg.short():<60} {' '.join(kinds or precompile_kinds(cfg))}")
        print(f"{len(configs)} configurations, {sum(len(kinds or precompile_kinds(c)) for c in configs)} kernels")
        return 0
    from ...errors import CacheDirError

    try:
        failures = precompile(configs, kinds=kinds, jobs=args.jobs, out=sys.stdout)
    except CacheDirError as exc:
        print(f"flashsink precompile: {exc}", file=sys.stderr)
        return 2
    return 1 if failures else 0


def add_parser(sub) -> None:
    from ..._argtypes import add_command, positive_int

    p = add_command(
        sub, "precompile", cmd_precompile,
        help="compile kernels ahead of time into the kernel cache (no GPU needed)",
        description="Compile the kernels for every combination of the options below, in parallel "
        "processes, into flashsink's kernel cache (FLASHSINK_CACHE_DIR, default ~/.cache/flashsink; "
        "see `flashsink cache info`), so a later process loads them instead of compiling on its "
        "first call. Kernels already cached are checked and kept. Works on a machine "
        "without a GPU (nvcc is needed). Sequence lengths, batch, window size and scale are runtime "
        "values: they need no kernels of their own. Exit code 1 if any kernel fails to build.",
    )
    p.add_argument("--arch", nargs="+", choices=SUPPORTED_ARCHS, default=["sm_90a"], help="default sm_90a")
    p.add_argument("--dtype", nargs="+", choices=tuple(_DTYPES), default=["bf16", "fp16"], help="default bf16 fp16")
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 128], help="default 64 128")
    p.add_argument("--groups", nargs="+", type=int, default=[1, 8],
                   help="query heads per KV head (GQA ratio H/H_kv); default 1 8 (gpt-oss: 8)")
    p.add_argument("--layout", nargs="+", choices=("bhsd", "bshd"), default=["bhsd"], help="default bhsd")
    p.add_argument("--varlen", action="store_true",
                   help="also the packed variable-length kernels (attention_varlen, layout thd)")
    p.add_argument("--sinks", choices=("yes", "no", "both"), default="yes", help="default yes")
    p.add_argument("--mask", choices=("causal", "full", "both"), default="causal",
                   help="causal (with or without a window: the window is a runtime value) or full; default causal")
    p.add_argument("--deterministic", action="store_true", help="also the deterministic=True backward")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["fast"],
                   help="the backward's precision modes (default fast, flashsink.attention's default)")
    p.add_argument("--kinds", nargs="+", choices=tuple(_REGISTRY), help="only these kernels (default: all a configuration needs)")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel processes, >= 1 (default: CPU count)")
    p.add_argument("--dry-run", action="store_true", help="list what would be compiled and exit")
