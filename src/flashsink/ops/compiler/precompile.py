"""``flashsink precompile``: many kernels compiled ahead of time, in parallel processes, into the disk
cache, so later processes load them. A kernel already cached is loaded and counted as cached. No GPU
needed: the architecture is part of each ``KernelConfig``. The kernels are a product of options, or
listed in JSONL files (:func:`read_kernels`); :func:`pack_bundle` carries the cache to a GPU machine.
"""

import dataclasses
import itertools
import json
import os
import sys
import tarfile
import time
from pathlib import Path

from ...kernel_config import HEAD_DIM_RULE, PRECISIONS, SUPPORTED_ARCHS, KernelConfig, kernel_head_dim
from . import diskcache
from .kinds import KINDS as _REGISTRY, canonical, kinds_for, precompile_kinds
from .registry import compile_parallel

__all__ = ["pack_bundle", "precompile", "read_kernels", "supported_kinds"]


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
# kernels listed in files, and the cache packed for another machine

#: the values a listed configuration's text fields may take (float32: merge_splits' partials)
_CHOICES = {"arch": SUPPORTED_ARCHS, "dtype": ("float16", "bfloat16", "float32"),
            "layout": ("bhsd", "bshd", "thd"), "precision": PRECISIONS}
_INTS = ("head_dim", "head_dim_v", "groups")
_FIELDS = tuple(f.name for f in dataclasses.fields(KernelConfig))
#: the forwards after which a recorded call stopped before its backward (see read_kernels)
_RECORDED_FORWARDS = ("fwd", "fwd_window")


def _check_path(path, name: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    return Path(path)


def _kernel(obj, recorded: bool) -> tuple:
    """One line's (kind, KernelConfig); ValueError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    fields = dict(obj)
    kind = fields.pop("kind", None)
    if not isinstance(kind, str):
        raise ValueError(f'"kind" must be a kernel kind (a string), got {kind!r}')
    if recorded and kind not in _REGISTRY and kind.startswith("fwd"):
        kind = "fwd"  # a forward kind since removed (an older run's record)
    if kind not in _REGISTRY:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {tuple(_REGISTRY)}")
    wrong = [f"{what} {', '.join(names)}" for what, names in (
        ("missing", [f for f in _FIELDS if f not in fields]), ("unknown", [f for f in fields if f not in _FIELDS]))
        if names]
    if wrong:
        raise ValueError(f"{'; '.join(wrong)} (a line is \"kind\" and the KernelConfig fields: {', '.join(_FIELDS)})")
    for name, value in fields.items():
        if name in _CHOICES:
            ok = value in _CHOICES[name]
        elif name in _INTS:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        else:
            ok = isinstance(value, bool)
        if not ok:
            need = (f"one of {_CHOICES[name]}" if name in _CHOICES else "an int >= 1" if name in _INTS
                    else "true or false")
            raise ValueError(f"{name} must be {need}, got {value!r}")
    return kind, KernelConfig(**fields)


def read_kernels(path, *, recorded: bool = False) -> list:
    """The (kind, KernelConfig) pairs a JSONL file lists, in order, each once: one JSON object a line,
    ``kind`` and the KernelConfig fields (what ``pytest --record-kernels`` writes); blank lines skipped.

    ``recorded``: the file is a test run's record, where every call stopped at the first kernel it asked
    for, so a recorded forward (``fwd``, ``fwd_window``) brings the rest of its configuration's kernels
    (``kinds_for``: the backward it never reached); a lone kernel's configuration brings none
    (merge_splits' float32 partials are no forward's dtype). A forward kind since removed (an older
    run's) is read as ``fwd``.

    ValueError naming the file and line of anything else (damaged or foreign lines), OSError for a file
    that cannot be read."""
    path = _check_path(path, "path")
    pairs = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                pairs.append(_kernel(json.loads(line), recorded))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg}, column {exc.colno})") from None
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
    pairs = list(dict.fromkeys(pairs))
    if recorded:
        pairs += [(k, cfg) for kind, cfg in pairs if kind in _RECORDED_FORWARDS for k in kinds_for(cfg)]
    return list(dict.fromkeys(pairs))


def pack_bundle(path, root=None) -> int:
    """Write the cache's compiled kernels (its ``kernels/`` folder, whatever built them) to ``path``, an
    xz-compressed tar archive with ``kernels/...`` at its root: what ``tools/unpack_kernel_bundle.sh``
    unpacks into an empty cache on a GPU machine, which checks every entry and rebuilds one it cannot
    load. ``root``: the cache directory (default this process's). Returns the number of entries."""
    path = _check_path(path, "path")
    root = diskcache.ensure_cache_dir(None if root is None else _check_path(root, "root"))
    kernels = root / "kernels"
    part = path.with_name(path.name + ".part")  # no half-written archive under the name asked for
    try:
        with tarfile.open(part, "w:xz") as tar:
            tar.add(kernels, arcname="kernels")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return len(os.listdir(kernels))


# ----------------------------------------------------------------------------------------------
# `flashsink precompile`: fill the kernel cache ahead of time (a login node, CI, a Docker build)

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
#: the configuration options and their defaults: None in the parser, so that an option named beside
#: --kernels or --recorded (which list their own configurations) is told from one left out
_PRODUCT = {"arch": ["sm_90a"], "dtype": ["bf16", "fp16"], "head_dim": [64, 128], "groups": [1, 8],
            "layout": ["bhsd"], "varlen": False, "sinks": "yes", "mask": "causal", "deterministic": False,
            "precision": ["fast"], "kinds": None}


def configs_from_args(args) -> list:
    """Every KernelConfig the options ask for (the product of the option lists)."""
    args = dict(_PRODUCT, **{k: v for k, v in vars(args).items() if k in _PRODUCT and v is not None})
    for d in args["head_dim"]:
        if kernel_head_dim(d) is None:
            raise ValueError(f"--head-dim: {d} is not one of the kernels' head dims ({HEAD_DIM_RULE})")
    for g in args["groups"]:
        if g < 1:
            raise ValueError(f"--groups: {g} must be >= 1 (query heads per KV head)")
    sinks = {"yes": (True,), "no": (False,), "both": (True, False)}[args["sinks"]]
    causal = {"causal": (True,), "full": (False,), "both": (True, False)}[args["mask"]]
    det = (False, True) if args["deterministic"] else (False,)
    layouts = list(dict.fromkeys(list(args["layout"]) + (["thd"] if args["varlen"] else [])))
    out = [KernelConfig(arch=arch, dtype=_DTYPES[dtype], head_dim=d, head_dim_v=d, groups=g, causal=c, has_sinks=s,
                        layout=layout, deterministic=dt, precision=prec)
           for arch, dtype, d, g, layout, s, c, dt, prec in itertools.product(
               args["arch"], args["dtype"], dict.fromkeys(kernel_head_dim(d) for d in args["head_dim"]),
               args["groups"], layouts, sinks, causal, det, dict.fromkeys(args["precision"]))]
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


def pairs_from_args(args) -> list:
    """The (kind, config) pairs of the ``--kernels`` and ``--recorded`` files, one line each on stdout;
    ValueError for a configuration option named beside them, or a damaged file."""
    if not (args.kernels or args.recorded):
        return []
    named = ["--" + k.replace("_", "-") for k in _PRODUCT if getattr(args, k) not in (None, False)]
    if named:
        raise ValueError(f"--kernels and --recorded list their own configurations: {' '.join(named)} cannot "
                         "be added to them (run flashsink precompile once for each)")
    pairs = []
    for option, paths, recorded in (("--kernels", args.kernels, False), ("--recorded", args.recorded, True)):
        for path in paths or ():
            try:
                got = read_kernels(path, recorded=recorded)
            except OSError as exc:
                raise ValueError(f"{option} {path}: cannot read it ({exc.strerror or exc})") from None
            except ValueError as exc:
                raise ValueError(f"{option} {exc}") from None
            what = "recorded kernels and their configurations' others" if recorded else "kernels"
            print(f"{path}: {len(got)} {what}", flush=True)
            pairs += got
    return list(dict.fromkeys(pairs))


def _plan(configs, kinds, pairs) -> dict:
    """config -> the kinds built for it, in the order precompile is given them."""
    plan = {cfg: tuple(kinds or precompile_kinds(cfg)) for cfg in configs}
    for kind, cfg in pairs:
        plan[cfg] = tuple(dict.fromkeys(plan.get(cfg, ()) + (kind,)))
    return plan


def cmd_precompile(args) -> int:
    try:
        pairs = pairs_from_args(args)
        configs = [] if args.kernels or args.recorded else configs_from_args(args)
        kinds = kinds_from_args(args, configs)
    except ValueError as exc:
        print(f"flashsink precompile: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        plan = _plan(configs, kinds, pairs)
        for cfg, cfg_kinds in plan.items():
            print(f"{cfg.short():<60} {' '.join(cfg_kinds)}")
        print(f"{len(plan)} configurations, {sum(map(len, plan.values()))} kernels")
        return 0
    from ...errors import CacheDirError

    try:
        failures = precompile(configs, kinds=kinds, pairs=pairs, jobs=args.jobs, out=sys.stdout)
    except CacheDirError as exc:
        print(f"flashsink precompile: {exc}", file=sys.stderr)
        return 2
    if args.bundle:
        try:
            n = pack_bundle(args.bundle)
        except OSError as exc:
            print(f"flashsink precompile: --bundle {args.bundle}: cannot write it ({exc.strerror or exc})",
                  file=sys.stderr)
            return 1
        print(f"bundle: {n} kernels in {args.bundle} ({os.path.getsize(args.bundle) / 2**20:.1f} MiB)", flush=True)
    return 1 if failures else 0


HELP = "compile kernels ahead of time into the kernel cache (no GPU needed)"
DESCRIPTION = (
    "Compile the kernels for every combination of the options below, or those listed in --kernels and "
    "--recorded files, in parallel processes, into flashsink's kernel cache (FLASHSINK_CACHE_DIR, default "
    "~/.cache/flashsink; see `flashsink cache info`), so a later process loads them instead of compiling on "
    "its first call. Kernels already cached are checked and kept. Works on a machine without a GPU (nvcc is "
    "needed). Sequence lengths, batch, window size and scale are runtime values: they need no kernels of "
    "their own. Exit code 1 if any kernel fails to build."
)


def add_parser(sub) -> None:
    from ..._argtypes import add_command, positive_int

    p = add_command(sub, "precompile", cmd_precompile, help=HELP, description=DESCRIPTION)
    p.add_argument("--arch", nargs="+", choices=SUPPORTED_ARCHS, help="default sm_90a")
    p.add_argument("--dtype", nargs="+", choices=tuple(_DTYPES), help="default bf16 fp16")
    p.add_argument("--head-dim", nargs="+", type=int, help="default 64 128")
    p.add_argument("--groups", nargs="+", type=int, help="query heads per KV head (GQA ratio H/H_kv); default 1 8 "
                   "(gpt-oss: 8)")
    p.add_argument("--layout", nargs="+", choices=("bhsd", "bshd"), help="default bhsd")
    p.add_argument("--varlen", action="store_true",
                   help="also the packed variable-length kernels (attention_varlen, layout thd)")
    p.add_argument("--sinks", choices=("yes", "no", "both"), help="default yes")
    p.add_argument("--mask", choices=("causal", "full", "both"),
                   help="causal (with or without a window: the window is a runtime value) or full; default causal")
    p.add_argument("--deterministic", action="store_true", help="also the deterministic=True backward")
    p.add_argument("--precision", nargs="+", choices=PRECISIONS,
                   help="the backward's precision modes (default fast, flashsink.attention's default)")
    p.add_argument("--kinds", nargs="+", choices=tuple(_REGISTRY), help="only these kernels (default: all a configuration needs)")
    p.add_argument("--kernels", nargs="+", metavar="FILE",
                   help="instead of the options above: exactly the kernels these JSONL files list (one JSON object "
                   'a line: "kind" and the KernelConfig fields)')
    p.add_argument("--recorded", nargs="+", metavar="FILE",
                   help="instead of the options above: the kernels a test run recorded (flashsink's tests: pytest "
                   "--record-kernels FILE), and with each recorded forward its configuration's other kernels")
    p.add_argument("--bundle", metavar="PATH",
                   help="then pack the cache's kernels into PATH, a tar.xz archive with kernels/... at its root, for "
                   "another machine: unpacked into its empty cache (tar -xJf PATH -C CACHE_DIR), every entry is "
                   "checked there and one it cannot load rebuilt")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel processes, >= 1 (default: CPU count)")
    p.add_argument("--dry-run", action="store_true", help="list what would be compiled and exit")

