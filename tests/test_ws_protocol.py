"""Models of the warp-specialized kernels' synchronization, run on the CPU: the forward's
(``ops/kernels/fwd_ws.py``) and the main backward's (``ops/kernels/bwd_ws.py``).

The kernels' hand-placed mbarrier waits and arrivals (the forward's Q slots and K/V ring, the
backward's ring and dQ hand-off, their phases) and the consumers' named barriers (the forward's
ping-pong turns, the backward's once-per-block meeting) are replayed here with the kernels' own
phase arithmetic and block ranges (``block_range.kv_blocks_for_rows``), one generator per warpgroup,
under a round-robin scheduler. A protocol that deadlocks stops making progress; a consumer that
reads a ring slot holding another tile than the one it wants is a stale read. Both fail the test.

They check the protocols, not the CUDA: the models mirror the kernels' loops by hand (the forward,
the backward) and must follow them when the kernels' synchronization changes. The forward's model is
also run with one fault injected (a wait or an arrival left out) to show that it catches a broken protocol.
What they caught before: the forward's former ``wg_ranges`` option with its last P V after the loop
deadlocked a 192-row tile's first warpgroup with 64-key tiles and 2 ring slots (docs/perf-log.md v16;
the option is gone, perf-log v31).
"""

import itertools

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.tir.block_range import kv_blocks_for_rows  # noqa: E402

pytestmark = pytest.mark.l0

THREADS = 128  # one warpgroup


class _MBarrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``done(parity)`` is try_wait.parity's answer."""

    def __init__(self, count: int):
        self.count, self.left, self.phase = count, count, 0

    def arrive(self, n: int = THREADS):
        self.left -= n
        assert self.left >= 0, "more arrivals than the barrier's count in one phase"
        if self.left == 0:
            self.phase, self.left = self.phase + 1, self.count

    def done(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class _Named:
    """A named barrier of 256 threads: one warpgroup's bar.sync and another's bar.arrive."""

    def __init__(self):
        self.arrived, self.generation = 0, 0


def _schedule(agents, barriers, named) -> str:
    """Run the warpgroups' generators round-robin until all finish (``"ok"``) or the barriers' state
    stops changing while none finishes (``"deadlock"``)."""
    agents, idle_rounds, last_state = list(agents), 0, None
    while agents:
        finished = False
        for a in list(agents):
            try:
                next(a)
            except StopIteration:
                agents.remove(a)
                finished = True
        state = tuple((b.phase, b.left) for b in barriers) + tuple((n.arrived, n.generation) for n in named)
        idle_rounds = 0 if finished or state != last_state else idle_rounds + 1
        if idle_rounds > 50:
            return "deadlock"
        last_state = state
    return "ok"


def _blocks(row0, rows, bn, seq, window):
    return tuple(int(x) for x in kv_blocks_for_rows(row0, rows, bn, seq, seq, window, True))


def _tiles(seq, bm, bn, window, ctas, cta):
    """The (row0, lo, hi) of one persistent program's query tiles, causal tiles longest first."""
    m_tiles = -(-seq // bm)
    return [(i * bm, *_blocks(i * bm, bm, bn, seq, window)) for i in [m_tiles - 1 - j for j in range(m_tiles)][cta::ctas]]


FAULTS = (None, "no_k_release", "no_k_wait")


def _run(tiles, n_cons, stages, q_slots, pingpong, fault=None):
    """``"ok"`` or ``"deadlock"``, and the stale reads seen, of ``build_fwd_ws``'s producer and
    consumers over one program's ``tiles``. ``fault`` (tests of the model): ``"no_k_release"``, the
    consumers never release a K slot; ``"no_k_wait"``, they read K without waiting for it to land."""
    assert fault in FAULTS, fault
    consumers = THREADS * n_cons
    q_full, q_empty = [_MBarrier(THREADS) for _ in range(q_slots)], [_MBarrier(consumers) for _ in range(q_slots)]
    k_full, v_full = [_MBarrier(THREADS) for _ in range(stages)], [_MBarrier(THREADS) for _ in range(stages)]
    k_empty, v_empty = [_MBarrier(consumers) for _ in range(stages)], [_MBarrier(consumers) for _ in range(stages)]
    held_k, held_v = [None] * stages, [None] * stages  # the KV tile each ring slot holds
    turns = [_Named() for _ in range(n_cons)]
    stale = []

    def q_phase(q_done):
        return (q_done // q_slots) & 1 if q_slots > 1 else q_done & 1

    def producer():
        kv_done = q_done = 0
        for _, lo, hi in tiles:
            if hi > lo:
                while not q_empty[q_done % q_slots].done(q_phase(q_done) ^ 1):
                    yield
                q_full[q_done % q_slots].arrive()
                q_done += 1
            for it in range(hi - lo):
                c = kv_done + it
                s, parity = c % stages, ((c // stages) & 1) ^ 1
                while not k_empty[s].done(parity):
                    yield
                held_k[s] = c
                k_full[s].arrive()
                while not v_empty[s].done(parity):
                    yield
                held_v[s] = c
                v_full[s].arrive()
            kv_done += hi - lo

    def arrive_turn(w):
        b = turns[w]
        b.arrived += THREADS
        if b.arrived == 2 * THREADS:
            b.arrived, b.generation = 0, b.generation + 1

    def take_turn(w):
        b, generation = turns[w], turns[w].generation
        arrive_turn(w)
        while b.generation == generation:
            yield

    def read(held, s, c, what, w):
        if held[s] != c:
            stale.append(f"warpgroup {w} reads {what} slot {s} holding tile {held[s]}, wants {c}")

    def consumer(w):
        kv_done = q_done = 0
        if pingpong and w == 0:
            arrive_turn(0)
        for _, lo, hi in tiles:
            n = hi - lo
            if n > 0:
                while not q_full[q_done % q_slots].done(q_phase(q_done)):
                    yield
            for it in range(n):
                c = kv_done + it
                s, sp = c % stages, (c - 1) % stages
                while fault != "no_k_wait" and not k_full[s].done((c // stages) & 1):
                    yield
                if it > 0:  # the previous tile's P V
                    while not v_full[sp].done(((c - 1) // stages) & 1):
                        yield
                if pingpong:
                    yield from take_turn(w)
                read(held_k, s, c, "K", w)
                if it > 0:
                    read(held_v, sp, c - 1, "V", w)
                if pingpong:
                    arrive_turn((w + 1) % n_cons)
                if fault != "no_k_release":
                    k_empty[s].arrive()
                if it > 0:
                    v_empty[sp].arrive()
            if n > 0:
                q_empty[q_done % q_slots].arrive()
                q_done += 1
                last = kv_done + n - 1  # the last P V, after the loop
                while not v_full[last % stages].done((last // stages) & 1):
                    yield
                read(held_v, last % stages, last, "V", w)
                v_empty[last % stages].arrive()
            kv_done += n

    barriers = q_full + q_empty + k_full + v_full + k_empty + v_empty
    return _schedule([producer()] + [consumer(w) for w in range(n_cons)], barriers, turns), stale


@pytest.mark.parametrize("n_cons", [2, 3])
def test_protocol_completes_without_stale_reads(n_cons):
    """2 and 3 consumer warpgroups, 64- and 128-key tiles, 2-4 ring slots, one or two Q slots,
    ping-pong on and off, windows 64 / 128 / 200 / none, sequences whose tiles end mid-tile, two
    programs of a persistent grid of three."""
    for bn, stages, q_slots, pingpong, window, seq, cta in itertools.product(
            (64, 128), (2, 3, 4), (1, 2), (True, False), (64, 128, 200, 1 << 30), (700, 1500), (0, 1)):
        tiles = _tiles(seq, 64 * n_cons, bn, window, 3, cta)
        result, stale = _run(tiles, n_cons, stages, q_slots, pingpong)
        assert (result, stale) == ("ok", []), dict(bn=bn, stages=stages, q_slots=q_slots, pingpong=pingpong,
                                                   window=window, seq=seq, cta=cta)


def test_the_forward_model_catches_a_broken_protocol():
    """The same model with one fault: K slots never released deadlocks the producer once the ring
    wraps (ping-pong on and off); K read without its wait (ping-pong off: no turn to wait through
    first) reads a slot the producer has not filled yet."""
    tiles = _tiles(1024, 192, 64, 1 << 30, 1, 0)
    for pingpong in (True, False):
        assert _run(tiles, 3, 2, 2, pingpong, fault="no_k_release")[0] == "deadlock", pingpong
    result, stale = _run(tiles, 3, 2, 2, False, fault="no_k_wait")
    assert stale, result


# -- the main backward (ops/kernels/bwd_ws.py) -----------------------------------------------------------


def _run_bwd(n_it, stages, with_dq, dq_first):
    """One program of the hand warp-specialized main backward: the producer fills the ring (Q, dO, lse,
    Delta of a row block per slot) and bulk-adds each handed-off dQ tile; two consumers wait for a slot,
    meet once per block (the shared dS^T, with dQ), release the slot and hand dQ over (``dq_first``:
    before the release). ``"ok"`` or ``"deadlock"``, and the stale reads seen (a slot, or dq_s, holding
    another block than the one read)."""
    full, empty = [_MBarrier(THREADS) for _ in range(stages)], [_MBarrier(2 * THREADS) for _ in range(stages)]
    dq_full, dq_empty = _MBarrier(2 * THREADS), _MBarrier(THREADS)
    meet = _Named()
    held = [None] * stages
    dq_held = [None]
    stale = []

    def add_dq(it, n):  # the bulk add reads dq_s: it must hold block it's dQ; n threads then release it
        while not dq_full.done(it & 1):
            yield
        if dq_held[0] != it:
            stale.append(f"the dQ add reads dq_s holding block {dq_held[0]}, wants {it}")
        dq_empty.arrive(n)

    def producer():
        for it in range(n_it):
            s = it % stages
            while not empty[s].done(((it // stages) & 1) ^ 1):
                yield
            held[s] = it
            full[s].arrive(THREADS)
            if with_dq and it > 0:  # the previous block's dQ, while the consumers work on this one
                yield from add_dq(it - 1, THREADS)
        if with_dq and n_it > 0:
            while not dq_full.done((n_it - 1) & 1):
                yield
            if dq_held[0] != n_it - 1:
                stale.append(f"the last dQ add reads dq_s holding block {dq_held[0]}")

    def meet_both():  # the consumers' named barrier: both warpgroups bar.sync, 256 threads
        generation = meet.generation
        meet.arrived += THREADS
        if meet.arrived == 2 * THREADS:
            meet.arrived, meet.generation = 0, meet.generation + 1
            return
        while meet.generation == generation:
            yield

    def hand_dq(it):
        while not dq_empty.done((it & 1) ^ 1):
            yield
        if w_first(it):
            dq_held[0] = it  # both consumers write their rows of dq_s; the model records the first write
        dq_full.arrive()

    written = set()

    def w_first(it):
        first = it not in written
        written.add(it)
        return first

    def consumer(w):
        for it in range(n_it):
            s = it % stages
            while not full[s].done((it // stages) & 1):
                yield
            if held[s] != it:
                stale.append(f"consumer {w} reads slot {s} holding block {held[s]}, wants {it}")
            if with_dq:
                yield from meet_both()
            if held[s] != it:  # dK's product reads Q, dV's dO: still this block's
                stale.append(f"consumer {w}: slot {s} overwritten before its release")
            if with_dq and dq_first:
                yield from hand_dq(it)
            empty[s].arrive()
            if with_dq and not dq_first:
                yield from hand_dq(it)

    agents = [producer(), consumer(0), consumer(1)]
    return _schedule(agents, full + empty + [dq_full, dq_empty], [meet]), stale


def test_bwd_protocol_completes_without_stale_reads():
    """The main backward's ring and dQ hand-off, dQ handed over before or after the slot's release,
    1-3 ring slots, 0-9 row blocks, and the deterministic kernel's (no dQ)."""
    for n_it, stages, with_dq, dq_first in itertools.product(range(10), (1, 2, 3), (True, False), (False, True)):
        result, stale = _run_bwd(n_it, stages, with_dq, dq_first)
        assert (result, stale) == ("ok", []), dict(n_it=n_it, stages=stages, with_dq=with_dq, dq_first=dq_first)
