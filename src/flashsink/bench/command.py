"""``flashsink bench``: its arguments, their checks, and the run they start."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from .. import testing
from .flashsink_systems import FlashSink
from .host_chain import REPS as HOST_CHAIN_REPS
from .peers import SYSTEMS
from .plotting import plot
from .problems import MODES, PRESETS, Problem, parse_shape, preset_problems
from .report import format_table
from .run import say, run_bench
from .timing import Timer


NO_CUDA_MESSAGE = (
    "error: flashsink bench needs a CUDA GPU (torch.cuda.is_available() is False here). "
    "Run it on a GPU machine, or pass --device cpu for a tiny smoke run of the CPU paths "
    "(reference and flashsink's PyTorch fallback; not a performance number)."
)
CPU_DEFAULT_SHAPE = "1,4,2,128,32,32"


def _precompile(problems: list[Problem], device: str, systems=((False, "fast"),)) -> None:
    """Build flashsink's kernels for these problems in parallel processes (TileLang's disk cache),
    so the in-process first calls load rather than compile them one after another; ``systems``: the
    (deterministic, precision) pairs of the flashsink rows being timed."""
    from .._validate import validate_attention
    from ..ops.launch.dense import kernel_config
    from ..ops.compiler.precompile import precompile

    cfgs = []
    for p in problems:
        if p.seqlens is not None or p.hf_train:
            continue  # the varlen kernels (and the model's) compile in-process on their first call (the gate)
        inp = testing.make_inputs(p.batch, p.heads, p.kv_heads, 1, 1, p.head_dim, p.torch_dtype, "cpu", seed=0)
        spec = validate_attention(inp["q"], inp["k"], inp["v"], inp["sinks"], window=p.window, causal=p.causal,
                                  scale=None, layout="bhsd")
        try:
            cfgs += [kernel_config(spec, torch.device(device), det, prec) for det, prec in systems]
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
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{option} {path}: not a regular file (a device, FIFO or socket); give a file path")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise ValueError(f"{option} {path}: not writable")


PLOT_INSTALL = "pip install 'flashsink[plot]'"


def _check_plot_deps(path) -> None:
    """ValueError naming the install command when ``--plot`` is given and matplotlib is not importable:
    before the run, not after it."""
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--plot {path} needs matplotlib, which is not importable ({exc}); install it with "
                         f"{PLOT_INSTALL} (or pip install matplotlib), or drop --plot") from None


def cmd_bench(args) -> int:
    if getattr(args, "host_chain", False):
        from .host_chain import cmd_host_chain

        return cmd_host_chain(args, check_output_path=_check_output_path)
    if getattr(args, "chain_reps", None) is not None:
        print("error: --chain-reps goes with --host-chain", file=sys.stderr)
        return 2
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
        _check_plot_deps(args.plot)
        if args.seq is not None and args.shape is not None:
            raise ValueError("--seq selects lengths of the presets' sweeps; --shape gives its own length")
        keep = None if args.seq is None else _parse_seq(args.seq)  # "" too: checked whatever runs
        if args.shape is not None:  # "" too: a usage error, not the default problem
            problems = [parse_shape(args.shape, args.dtype or ("fp32" if device == "cpu" else "bf16"),
                                    causal=not args.no_causal)]
        elif device == "cpu" and args.preset is None:
            if keep is not None:
                raise ValueError("--seq selects lengths of the presets' sweeps: on --device cpu give --preset too "
                                 "(without one it runs a single small problem)")
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
            if keep is not None:
                lengths = sorted({p.n for p in problems})
                problems = [p for p in problems if p.n in keep]
                if not problems:
                    raise ValueError(f"--seq {args.seq} matches no problem of {', '.join(names)}"
                                     f"{' (the tiny CPU versions)' if device == 'cpu' else ''}; their lengths: "
                                     f"{','.join(map(str, lengths))}")
        if args.shape is not None and args.preset is not None:
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

    ours = [SYSTEMS[s] for s in systems if issubclass(SYSTEMS[s], FlashSink)]
    if device == "cuda" and not args.no_precompile and ours:
        _precompile(problems, device, tuple(dict.fromkeys((c.deterministic, c.precision) for c in ours)))
    if device == "cpu":  # a smoke run: a few repetitions are enough
        timer = Timer(device, rep_ms=min(args.rep_ms, 20.0), min_reps=3)
    else:
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)

    def save(res):
        if args.json:
            try:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1, default=str)
            except OSError as exc:  # e.g. the disk filled up during the run: one line, not a traceback
                raise _WriteFailed(f"error: could not write --json {args.json}: {exc.strerror or exc}") from None

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
    except _WriteFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    except (_Interrupted, KeyboardInterrupt):
        interrupted = True
        say("interrupted: reporting the problems finished so far")
        if "ceilings" not in result:
            return 124
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    if interrupted:
        result["interrupted"] = True
    print(format_table(result), flush=True)
    if args.json:
        try:
            save(result)
        except _WriteFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        say(f"wrote {args.json}")
    if args.plot:
        msg = plot(result, args.plot)
        say(msg or f"wrote {args.plot}")
    failed = [r for r in result["rows"] if r["status"].startswith("FAIL")
              and (getattr(SYSTEMS.get(r["system"]), "required_gate", None) or r["system"] == "hf/flashsink")]
    if interrupted:
        return 124
    return 1 if failed else 0


class _Interrupted(Exception):
    pass


class _WriteFailed(Exception):
    """The JSON output could not be written (its message is the one line to print)."""


def add_parser(sub) -> None:
    from .._argtypes import add_command, nonneg_float, positive_float, seed

    p = add_command(
        sub, "bench", cmd_bench,
        help="benchmark flashsink against FlexAttention, FLA, SDPA and the eager reference",
        description="Gate every system against the fp64 reference (precision standard), then time it: "
        "ms, TFLOP/s over visible pairs, GB/s, floor from ceilings measured in the same run, peak memory, "
        "speedup over the best peer with sinks. Exit 1 if flashsink fails its gate; 2 without CUDA "
        "(unless --device cpu, a tiny smoke run).",
    )
    p.add_argument("--preset", help=f"comma-separated of {', '.join(PRESETS)} or 'all' (default all); "
                   "gptoss-stack-4k / -16k: the gpt-oss attention stack, 24 layers (12 W=128 + 12 full) chained, each "
                   "output the next query, one backward, on 8 x 4096 / 2 x 16384 packed tokens")
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
    p.add_argument("--plot", metavar="PATH", help=f"write a PNG (needs matplotlib: {PLOT_INSTALL})")
    p.add_argument("--profile", action="store_true", help="per-kernel time table of flashsink's fwd+bwd")
    p.add_argument("--warmup-ms", type=nonneg_float, default=25.0, help="do_bench warm-up (default 25 ms)")
    p.add_argument("--rep-ms", type=positive_float, default=100.0, help="do_bench repetition time (default 100 ms)")
    p.add_argument("--eager-max-gib", type=nonneg_float, default=48.0,
                   help="skip eager above this score memory, GiB >= 0 (default 48)")
    p.add_argument("--no-gate2", action="store_true", help="gate 1 only (skips the low-precision reference)")
    p.add_argument("--no-precompile", action="store_true", help="compile flashsink kernels in-process")
    p.add_argument("--seed", type=seed, default=0, help="input seed in [0, 2**64) (default 0)")
    p.add_argument("--host-chain", action="store_true",
                   help="instead of the presets: the host time per layer of a 24-layer attention chain (B=1 N=4096 "
                   "H=64/8 D=64 bf16, W=128 / full alternating, each output the next query, one backward) for "
                   "flashsink, fa4 and sdpa (no sink), the GPU held busy (torch.cuda._sleep) so launches only queue; "
                   "us/layer and the ratio to sdpa. CUDA only; takes --systems, --json, --dtype, --seed, --chain-reps")
    p.add_argument("--chain-reps", type=int, default=None,
                   help=f"--host-chain: valid held repeats, median taken (default {HOST_CHAIN_REPS})")
