"""Command line: ``flashsink <command>`` (also ``python -m flashsink <command>``).

Commands:
    check   run the golden problem forward and backward through ``flashsink.attention`` and judge
            all six outputs against the float64 reference under the precision standard.
    bench   gate flashsink and its peers against the float64 reference, then time them
            (implementation in ``flashsink.bench``).
    precompile  compile kernels ahead of time into the kernel cache, no GPU needed
            (implementation in ``flashsink.ops.compiler.precompile``).
    cache   ``cache info``: where the kernel cache is, its entries and their state;
            ``cache clear``: remove them (implementation in ``flashsink.ops.compiler.diskcache``).
"""

from __future__ import annotations

import argparse
import sys
import time

from ._argtypes import add_command, positive_int, seed

# The seed's golden problem.
GOLDEN = dict(batch=1, heads=64, kv_heads=8, seq=4096, head_dim=128, window=128, dtype="fp16")
# On CPU the fp64 reference of the golden problem needs tens of GB and minutes; this keeps the
# head_dim, window and GQA ratio and is done in seconds.
CPU_SCALED = dict(batch=1, heads=16, kv_heads=2, seq=512, head_dim=128, window=128, dtype="fp16")

_DTYPES = ("fp16", "bf16", "fp32")
_FROM_BASE = object()  # --window not given: take the base problem's window


def _window(text: str):
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"window must be an int or 'none', got {text!r}") from None


def _default(name: str) -> str:
    if GOLDEN[name] == CPU_SCALED[name]:
        return f"default {GOLDEN[name]}"
    return f"default {GOLDEN[name]}, {CPU_SCALED[name]} on CPU"


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    """Shape options shared by commands that run one problem (check; later bench). Each defaults to None
    (not given): it then takes the device's base problem's value (_resolve_problem)."""
    p.add_argument("--batch", type=positive_int, help=f"batch size ({_default('batch')})")
    p.add_argument("--heads", type=positive_int, help=f"query heads ({_default('heads')})")
    p.add_argument("--kv-heads", type=positive_int, help=f"key/value heads ({_default('kv_heads')})")
    p.add_argument("--seq", type=positive_int, help=f"sequence length of q and k/v ({_default('seq')})")
    p.add_argument("--seq-q", type=positive_int, help="query length (overrides --seq)")
    p.add_argument("--seq-kv", type=positive_int, help="key/value length (overrides --seq)")
    p.add_argument("--head-dim", type=positive_int, help=f"head dim ({_default('head_dim')})")
    p.add_argument("--dtype", choices=_DTYPES, help=f"input dtype ({_default('dtype')})")
    p.add_argument("--window", type=_window, default=_FROM_BASE, help=f"sliding window W or 'none' (golden {GOLDEN['window']})")
    p.add_argument("--no-causal", action="store_true", help="full attention (needs --window none)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available")
    p.add_argument("--seed", type=seed, default=0, help="input seed in [0, 2**64) (default 0)")


def _resolve_problem(args, device: str) -> tuple[dict, str | None]:
    """The device's base problem (the golden one; on CPU the scaled-down one), each option given replacing
    its own value only: an option given its default value changes nothing."""
    given = {
        "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "seq": args.seq,
        "head_dim": args.head_dim, "dtype": args.dtype,
    }
    base, note = GOLDEN, None
    if device == "cpu":
        base = CPU_SCALED
        kept = [k for k in ("heads", "kv_heads", "seq") if given[k] is None and CPU_SCALED[k] != GOLDEN[k]]
        if kept and not (args.seq_q and args.seq_kv and kept == ["seq"]):
            note = (
                "note: running on CPU, where flashsink.attention is the PyTorch reference and the fp64 "
                "reference of the golden problem (B=1 H=64 H_kv=8 N=4096 D=128) would need tens of GB; "
                "scaled down to H={heads} H_kv={kv_heads} N={seq} (the options given replace these). "
                "Run on a CUDA machine to check the kernels.".format(**CPU_SCALED)
            )
    prob = {k: (v if v is not None else base[k]) for k, v in given.items()}
    prob["window"] = base["window"] if args.window is _FROM_BASE else args.window
    if args.no_causal and args.window is _FROM_BASE:
        prob["window"] = None  # a window needs causal; --no-causal alone means full attention
    prob["seq_q"] = args.seq_q if args.seq_q is not None else prob["seq"]
    prob["seq_kv"] = args.seq_kv if args.seq_kv is not None else prob["seq"]
    prob["causal"] = not args.no_causal
    return prob, note


# Bytes per element of the dense [B, H, S_q, S_kv] scores that `check` holds at its peak on the CPU, measured
# with ru_maxrss (H=16 H_kv=2 D=128 fp16, N=1024 and 2048): flashsink.attention's float32 forward and backward
# 26-29 over all the scores; the reference pair (float64 and the input dtype, testing.reference_pair) 51-56 over
# the KV heads it holds at once (_cases.CHUNK_SCORE_ELEMS). The two run one after the other.
_ATTN_BYTES, _REF_BYTES = 30, 56


def cpu_memory_needed(prob: dict) -> int:
    """About the peak memory in bytes of `check` on the CPU for ``prob``."""
    from ._cases import CHUNK_SCORE_ELEMS

    per_kv_head = prob["batch"] * (prob["heads"] // prob["kv_heads"]) * prob["seq_q"] * prob["seq_kv"]
    held = per_kv_head * max(1, min(prob["kv_heads"], CHUNK_SCORE_ELEMS // max(1, per_kv_head)))
    return max(_ATTN_BYTES * per_kv_head * prob["kv_heads"], _REF_BYTES * held)


def available_memory() -> int | None:
    """Bytes this process can still take: MemAvailable, less under a cgroup (v2) limit; None where unknown."""
    from pathlib import Path

    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _fitting_flags(prob: dict, avail: int) -> str:
    """The sequence option(s) that make ``prob`` fit in ``avail`` bytes (the others kept), else fewer heads."""
    def scaled(n):  # seq_kv = n, seq_q scaled with it
        return dict(prob, seq_q=max(1, prob["seq_q"] * n // prob["seq_kv"]), seq_kv=n)

    lo, hi = 0, prob["seq_kv"]  # the largest seq_kv that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cpu_memory_needed(scaled(mid)) <= avail:
            lo = mid
        else:
            hi = mid - 1
    if lo < 1:
        return "fewer --heads / --batch"
    p = scaled(lo - lo % 64 if lo >= 64 else lo)
    if prob["seq_q"] == prob["seq_kv"]:
        return f"--seq {p['seq_kv']}"
    return f"--seq-q {p['seq_q']} --seq-kv {p['seq_kv']}"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def cmd_check(args) -> int:
    import torch

    import flashsink
    from flashsink import testing
    from flashsink._validate import validate_attention

    def say(msg: str) -> None:
        print(msg, flush=True)

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
        if device == "cuda" and not torch.cuda.is_available():
            print("error: --device cuda given but CUDA is not available", file=sys.stderr)
            return 2
    prob, note = _resolve_problem(args, device)
    if note:
        say(note)

    dtype = testing.resolve_dtype(prob["dtype"])
    kw = dict(window=prob["window"], causal=prob["causal"])
    shapes = ((prob["heads"], prob["seq_q"]), (prob["kv_heads"], prob["seq_kv"]), (prob["kv_heads"], prob["seq_kv"]))
    try:  # the shapes, on meta tensors: nothing allocated before the memory check below
        q, k, v = (torch.empty(prob["batch"], h, s, prob["head_dim"], dtype=dtype, device="meta") for h, s in shapes)
        validate_attention(q, k, v, torch.empty(prob["heads"], device="meta"), scale=None, layout="bhsd", **kw)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if device == "cpu":
        need, avail = cpu_memory_needed(prob), available_memory()
        if avail is not None and need > avail:
            print(f"error: this check needs about {_gib(need)} of memory on the CPU (flashsink.attention's path "
                  f"there and the float64 reference hold the dense scores of B={prob['batch']} H={prob['heads']} "
                  f"H_kv={prob['kv_heads']} N_q={prob['seq_q']} N_kv={prob['seq_kv']}), but {_gib(avail)} is "
                  f"available; {_fitting_flags(prob, avail)} makes it fit (or run it on a CUDA machine)",
                  file=sys.stderr)
            return 1
    name = testing.case_id(
        batch=prob["batch"], heads=prob["heads"], kv_heads=prob["kv_heads"], seq_q=prob["seq_q"],
        seq_kv=prob["seq_kv"], head_dim=prob["head_dim"], window=prob["window"], dtype=dtype,
        causal=prob["causal"],
    )
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (PyTorch reference path)"
    say(f"flashsink {flashsink.__version__}, torch {torch.__version__}, device: {where}")
    say(f"problem {name}, seed {args.seed}")

    inp = testing.make_inputs(
        prob["batch"], prob["heads"], prob["kv_heads"], prob["seq_q"], prob["seq_kv"],
        prob["head_dim"], dtype, device, seed=args.seed,
    )

    def run(precision):
        leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "sinks")]
        _sync(device)
        t0 = time.perf_counter()
        o, lse = flashsink.attention(*leaves, return_lse=True, precision=precision, **kw)
        _sync(device)
        t1 = time.perf_counter()
        grads = torch.autograd.grad(o, leaves, inp["do"])
        _sync(device)
        t2 = time.perf_counter()
        out = dict(o=o.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2], dsink=grads[3])
        return out, t1 - t0, t2 - t1

    # every precision mode, each judged by its own gate: fast by the fast gate, strict by the standard
    runs = {}
    for precision in testing.PRECISIONS:
        try:
            say(f"flashsink.attention(precision={precision!r}) forward+backward (warm-up, includes any kernel "
                "compilation) ...")
            run(precision)
            runs[precision] = run(precision)
        except Exception as exc:  # a crash is a failed check, reported like one
            runs[precision] = f"flashsink.attention(precision={precision!r}) raised {type(exc).__name__}: {exc}"
            say(f"FAIL: {runs[precision]}")
            continue
        _, t_fwd, t_bwd = runs[precision]
        say(f"timed run ({precision}): forward {_ms(t_fwd)}, backward {_ms(t_bwd)}")

    expected, lowp = testing.reference_pair(**inp, **kw, progress=say, lowp_why="gate 2 and the fast gate")
    failed = []
    for precision, got in runs.items():
        gate = "the fast gate" if precision == "fast" else "the precision standard"
        say("")
        say(f"precision={precision!r}, judged by {gate}:")
        if isinstance(got, str):
            failed.append(f"{precision} (raised)")
            say(f"FAIL: {got}")
            continue
        actual, t_fwd, t_bwd = got
        reports = testing.judge_all(actual, expected, lowp, dtype, precision=precision)
        for r in reports:
            r.timing = f"fwd {_ms(t_fwd)}" if r.name in ("o", "lse") else f"bwd {_ms(t_bwd)}"
        say(testing.PrecisionReport.header())
        for r in reports:
            say(r.row())
        failed += [f"{precision} {r.name}" for r in reports if not r.passed]
    say("")
    say(f"check {'FAILED: ' + ', '.join(failed) if failed else 'passed'} (modes {', '.join(runs)})")
    return 1 if failed else 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _cache_root(args):
    """The cache directory and how it was chosen; checked, not created."""
    from pathlib import Path

    from .ops.compiler import diskcache

    if args.dir:
        return Path(args.dir).expanduser().absolute(), "--dir"
    import os

    how = f"{diskcache.ENV_DIR}" if os.environ.get(diskcache.ENV_DIR) else f"default; set {diskcache.ENV_DIR} to move it"
    return diskcache.cache_dir(), how


def _shown(text, stream=None) -> str:
    """``text`` (found on disk: a manifest's fields, file names) safe to print to ``stream``: control and
    format characters (terminal escapes, bidi overrides) and undecodable bytes escaped, characters the
    stream's encoding cannot write replaced."""
    import unicodedata

    text = "".join(ch if unicodedata.category(ch)[0] != "C" else ascii(ch)[1:-1] for ch in str(text))
    encoding = getattr(stream or sys.stdout, "encoding", None) or "utf-8"
    try:
        return text.encode(encoding, "replace").decode(encoding)
    except LookupError:  # a stream that names no codec Python knows
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _say(text: str, stream=None) -> None:
    print(_shown(text, stream), file=stream or sys.stdout)


def _unsafe(command: str, exc) -> int:
    _say(f"flashsink cache {command}: UNSAFE, flashsink refuses to use it: {exc}", sys.stderr)
    return 2


def cmd_cache_info(args) -> int:
    from .errors import CacheDirError
    from .ops.compiler import cachedir, diskcache

    root, how = _cache_root(args)
    _say(f"flashsink kernel cache: {root} ({how})")
    try:  # checked (ops.cachedir: the path from /, the subdirectories), never created; None: missing
        resolved = cachedir.trusted_root(root, create=False)
    except CacheDirError as exc:
        return _unsafe("info", exc)
    if resolved is None:
        print("it does not exist yet: 0 entries (the first compiled kernel creates it, mode 0700)")
        return 0
    print("permissions: it and every directory above it safe, owned by you, writable by nobody else: ok")
    found = diskcache.entries(resolved)
    total = sum(e.size for e in found)
    bad = [e for e in found if e.status != "ok"]
    print(f"{len(found)} entries, {_size(total)}" + (f", {len(bad)} failing verification" if bad else ""))
    if found:
        print(f"{'kind':<11} {'configuration':<58} {'size':>10}  {'tilelang':<9} {'created':<25} status")
        for e in found:  # every field as the manifest has it: shown escaped, never sent raw to the terminal
            kind, summary, created = _shown(e.kind), _shown(e.summary), _shown(e.created)
            cfg = summary.split(" ", 1)[1] if summary.startswith(kind + " ") else summary
            _say(f"{kind:<11} {cfg:<58} {_size(e.size):>10}  {_shown(e.versions.get('tilelang', '?')):<9} "
                 f"{created:<25} {e.status}")
            if args.verbose:
                _say(f"{'':<11} {e.name}  nvcc: {e.versions.get('nvcc', '?')}")
    return 0


def cmd_cache_clear(args) -> int:
    import os

    from .errors import CacheDirError
    from .ops.compiler import cachedir, diskcache

    root, _ = _cache_root(args)
    try:  # checked (ops.cachedir: the path from /, the subdirectories), never created; None: missing
        resolved = cachedir.trusted_root(root, create=False)
    except CacheDirError as exc:
        return _unsafe("clear", exc)
    if resolved is None or not any((resolved / sub).is_dir() for sub in diskcache.SUBDIRS):
        _say(f"flashsink kernel cache {root}: nothing to clear")
        return 0
    n = len(os.listdir(resolved / "kernels")) if (resolved / "kernels").is_dir() else 0
    if not args.yes:
        if not sys.stdin.isatty():
            _say(f"flashsink cache clear: would remove {n} entries from {root}; pass --yes to do it "
                 "without a prompt", sys.stderr)
            return 2
        answer = input(_shown(f"remove {n} compiled kernels from {root}? [y/N] "))
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    done = diskcache.clear(resolved)
    _say(f"removed {done.entries} entries ({_size(done.bytes)}) from {root}")
    if done.kept:
        print(f"left alone {len(done.kept)} item(s) that flashsink did not write (no valid flashsink marker "
              "names them); remove them yourself if you do not need them:")
        for path, why in done.kept:
            _say(f"  {path}: {why}")
    return 0


def _add_cache_parser(sub) -> None:
    p = add_command(
        sub, "cache",
        help="show or clear the on-disk kernel cache",
        description="flashsink keeps compiled kernels in FLASHSINK_CACHE_DIR (default "
        "$XDG_CACHE_HOME/flashsink, else ~/.cache/flashsink). `info` lists the entries and checks each "
        "against its recorded checksums; `clear` removes them (and leftover temporary files and unused "
        "locks): only what a valid flashsink marker names, listing what it leaves alone.",
    )
    csub = p.add_subparsers(dest="cache_command", metavar="{info,clear}")
    csub.required = True
    info = add_command(csub, "info", cmd_cache_info,
                       help="directory, entries, size, per-entry configuration and state")
    info.add_argument("--dir", help="a cache directory other than this environment's")
    info.add_argument("-v", "--verbose", action="store_true", help="also the entry names and nvcc versions")
    clear = add_command(csub, "clear", cmd_cache_clear, help="remove every compiled kernel from the cache",
                        description="Remove every entry. Asks first on a terminal; --yes skips the "
                        "question (needed when stdin is not a terminal, e.g. in scripts). A kernel "
                        "being compiled right now is not disturbed.")
    clear.add_argument("--dir", help="a cache directory other than this environment's")
    clear.add_argument("-y", "--yes", action="store_true", help="do not ask")


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="flashsink", description="flashsink: fused TileLang attention with learnable attention sinks"
    )
    parser.add_argument("--version", action="version", version=f"flashsink {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    p = add_command(
        sub, "check", cmd_check,
        help="golden problem forward+backward vs the fp64 reference",
        description="Run the golden problem (B=1 H=64 H_kv=8 N=4096 D=128 W=128 fp16, causal) forward "
        "and backward through flashsink.attention on the best device and judge o, lse, dq, dk, dv "
        "and dsink under the precision standard. Exit code 1 if any fails.",
    )
    _add_problem_args(p)
    from .bench import add_parser as add_bench_parser

    add_bench_parser(sub)
    from .ops.compiler.precompile import add_parser as add_precompile_parser

    add_precompile_parser(sub)
    _add_cache_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
