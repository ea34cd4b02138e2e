"""``flashsink bench``: flashsink against its peers, with a correctness gate before any timing.

For every problem (a preset, or ``--shape``) and every system:

1. **Gate.** The system runs forward and backward once on fresh inputs; its output (and, when a
   backward mode is asked for, dq / dk / dv / dsink) is judged against the float64 reference under
   both precision gates: :func:`flashsink.testing.check_precision` (gate 1 and gate 2, the precision
   standard: "strict") and :func:`flashsink.testing.check_fast` (the fast gate: "fast"). Each row
   says the strongest gate the system passes in its mode (strict, fast or none), and every system
   is timed, so speed and precision stand side by side; only a system that raises is not. flashsink
   must pass the gate of its own ``precision=`` (``flashsink``: fast, ``flashsink-strict``: strict),
   else its row says ``FAIL`` (timed all the same) and the command exits 1. SDPA has no sink: it is
   judged against the reference computed with ``sinks=None``.
2. **Timing** (METHOD.md): warm-up, then the median of many runs, through
   ``triton.testing.do_bench`` (CUDA events; it writes a 256 MB buffer between runs, so the L2
   never holds a previous iteration's data) or, without triton, CUDA events around each run with
   the same L2 flush. On ``--device cpu``: ``time.perf_counter``, median.
3. **Numbers.** TFLOP/s over the visible (q, k) pairs (exact count, bottom-right aligned), achieved
   GB/s over the fewest bytes the mode must move, the floor ``max(FLOPs / matmul ceiling,
   bytes / copy ceiling)`` with both ceilings measured at the start of the same run, % of floor,
   peak memory over the inputs, the speedup over the best peer that has sinks (fa4, cudnn, flex, fla) and
   passes a gate, and the host time: the enqueue time of 20 calls without a sync, per call, after
   warm-up (fwd and fwd+bwd; fwd+bwd as a training step calls it, ``o = f(...); o.backward(do)``).

Problems are dense ``[B, H, S, D]`` (``seq_q < seq_kv`` bottom-right aligned), varlen (a packed
``[total, H, D]`` batch, :attr:`Problem.seqlens`; pairs and bytes summed over its sequences, the
reference run per sequence) or decode (``seq_q = 1`` against a KV cache, :attr:`Problem.forward_only`:
its other modes are n/a). Every system gets a row for every problem and mode; one that cannot run
says why.

``flashsink`` runs ``precision="fast"`` (the default), ``flashsink-strict`` ``precision="strict"``;
``flashsink-graph`` / ``flashsink-strict-graph`` are the same replayed from CUDA graphs (fwd, bwd,
fwd+bwd): the kernels' time without the host's, next to the eager rows; their gate judges replays.

The pieces are plain functions so the tests can check them on the CPU (pair count, FLOP and byte
formulas, the gate) and inject systems (:data:`SYSTEMS`).

Layout: :mod:`.problems` (presets, :class:`Problem`, pairs, FLOPs, bytes), :mod:`.system` (the
:class:`System` interface), :mod:`.flashsink_systems` (flashsink's rows), :mod:`.peers` (the peers and the
:data:`SYSTEMS` registry; cuDNN's in :mod:`.cudnn_peer`), :mod:`.gates` (the reference and the gate), :mod:`.timing`, :mod:`.run` (the
loop over problems and systems), :mod:`.kernel_profile` (``--profile``), :mod:`.report` (table, summary),
:mod:`.plotting` (``--plot``), :mod:`.command` (the CLI), :mod:`.hf` (the ``hf-train`` preset), :mod:`.stack` (the
``gptoss-stack-*`` presets: a chain of layers, each output the next query), :mod:`.host_chain` (``--host-chain``:
the host time per layer of that chain with the GPU held busy).
"""

from .command import CPU_DEFAULT_SHAPE, NO_CUDA_MESSAGE, add_parser, cmd_bench
from .flashsink_systems import (FlashSink, FlashSinkGraph, FlashSinkKVCache, FlashSinkPaged, FlashSinkStrict,
                                FlashSinkStrictGraph)
from .gates import GATES, GateResult, gate, reference
from .kernel_profile import kernel_role, profile_flashsink
from .peers import SYSTEMS, Cudnn, Eager, Fa4, Fla, Flex, Sdpa
from .plotting import plot, plot_title
from .problems import (DECODE_PRESETS, FLOP_FACTOR, FORWARD_ONLY, HF_PRESETS, MODES, PAGE_SIZE, PRESETS,
                       STACK_PRESETS, TINY_PAGE_SIZE, TINY_PRESETS, VARLEN_PRESETS, VARLEN_SEED, Problem, flops, lengths_summary,
                       make_problem_inputs, min_bytes, parse_shape, preset_problems, problem_pairs, score_elems,
                       varlen_lengths, visible_pairs)
from .report import format_table, summary
from .run import header, run_bench
from .system import System, Unavailable
from .timing import HOST_CALLS, HOST_MODES, Timer, host_us, measure_ceilings
