"""One device call's check of the `cudnn` bench peer (issue 55): cuDNN's fused attention with a learnable
sink, forward and backward, through :class:`flashsink.bench.Cudnn` exactly as the bench runs it, judged
against flashsink's float64 reference (and the bf16 reference: the fast gate's yardstick).

UNTESTED ON GPUs when written: the peer's plumbing is tested on the CPU through a fake `cudnn`
(tests/test_bench_cudnn.py); this is its first contact with the real library.

    source .gpu/setup.sh && source .cudnn/setup.sh && python lab/cudnn_check.py

Problems: the required one, causal B=1 H=64 H_kv=8 N=1024 D=64 bf16 with sinks; then a window (W=128),
S_q < S_kv (bottom-right causal, B=2) and a small packed varlen batch (ragged), each of which may be n/a
(cuDNN's own refusal, printed). Per tensor (o, dq, dk, dv, dsink) it prints the max abs error against the
fp64 reference, bf16 torch's max abs error (the scale to read it by), the relative L2 error and the gates.
Exit 0: every problem that ran passes at least the fast gate and the required one ran; 1: a mismatch (or a
crash); 2: cuDNN unavailable here or the required problem n/a.
"""

from __future__ import annotations

import sys

import torch

from flashsink import bench
from flashsink.bench.gates import gate, reference

PROBLEMS = [
    (bench.parse_shape("1,64,8,1024,64", "bf16"), True),
    (bench.parse_shape("1,64,8,1024,64,128", "bf16"), False),
    (bench.parse_shape("2,64,8,512:1024,64", "bf16"), False),
    (bench.Problem("varlen-check", 4, 64, 8, 1024, 1024, 64, None, "bf16", seqlens=(300, 1024, 77, 600)), False),
]
SEED = 0


def check(system: bench.Cudnn, prob: bench.Problem, required: bool) -> int:
    """0 ok or n/a (not required), 1 mismatch, 2 the required problem n/a."""
    try:
        return _check(system, prob, required)
    finally:
        system.release()  # this problem's graphs and workspaces


def _check(system: bench.Cudnn, prob: bench.Problem, required: bool) -> int:
    print(f"\n== {prob.label()}{' (required)' if required else ''}", flush=True)
    try:
        system.check_problem(prob, "cuda", {"grads": True})  # builds the fwd and bwd graphs
    except bench.Unavailable as exc:
        print(f"   {exc}")
        return 2 if required else 0
    inp = bench.make_problem_inputs(prob, "cuda", SEED)
    exp = reference(inp, prob, sinks=True, compute_dtype=torch.float64)
    low = reference(inp, prob, sinks=True, compute_dtype=prob.torch_dtype)
    built = len(system._graphs)
    g = gate(system, prob, inp, exp, low, grads=True)
    if g.error:
        print(f"   FAIL: the peer raised: {g.error}")
        return 1
    if len(system._graphs) != built:
        print(f"   FAIL: the calls built {len(system._graphs) - built} more graph(s): the cache key misses")
        return 1
    fast = {r.name: r for r in g.fast_reports}
    print(f"   {'tensor':<7} {'max|err|':>10} {'bf16 torch':>10} {'rel L2':>9} {'strict':>6} {'fast':>5}")
    for r in g.reports:
        f = fast[r.name]
        print(f"   {r.name:<7} {r.max_abs:10.3e} {r.lowp_max_abs or 0:10.3e} {f.rel_l2 or 0:9.2e} "
              f"{'ok' if r.passed else 'FAIL':>6} {'ok' if f.passed else 'FAIL':>5}")
    label = g.label("fwd+bwd")
    print(f"   gate: {label}" + ("" if label == "strict" else f" (strict fails: {g.reason('fwd+bwd')})"))
    if label == "none":
        print(f"   FAIL: fails the fast gate too: {g.reason('fwd+bwd', 'fast')}")
        return 1
    return 0


def main() -> int:
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    system = bench.Cudnn()
    try:
        system.check_available("cuda")
    except bench.Unavailable as exc:
        print(f"error: cudnn peer unavailable: {exc}", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} (its cuDNN {torch.backends.cudnn.version()}) "
          f"| {system.version}")
    codes = [check(system, p, req) for p, req in PROBLEMS]
    worst = 1 if 1 in codes else max(codes)
    print("\nOK: every problem that ran passes a gate" if worst == 0 else
          "\nFAILED: " + ("a mismatch or a crash (above)" if worst == 1 else "the required problem is n/a"))
    return worst


if __name__ == "__main__":
    sys.exit(main())
