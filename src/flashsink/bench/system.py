"""What a benchmarked system is: the :class:`System` interface every row runs through, and
:class:`Unavailable` for a system that cannot run here or not this problem."""

from __future__ import annotations

import torch

from .problems import Problem, visible_pairs


class Unavailable(Exception):
    """The system cannot run here (or not this problem); the message says why."""


class System:
    name = "?"
    has_sink = True
    peer = False  # a peer with sinks: counts for "speedup over the best peer"
    note = ""
    required_gate: str | None = None  # flashsink: the gate of its precision= ("fast" / "strict"); peers: none
    cuda_only: str | None = None  # runs on CUDA only: why (the message of Unavailable elsewhere)
    no_varlen: str | None = None  # runs no varlen problem: why (the message of Unavailable)

    def check_available(self, device: str) -> None:
        """Raise :class:`Unavailable` if the system cannot run on this machine (``cuda_only``, off CUDA)."""
        if self.cuda_only is not None and device != "cuda":
            raise Unavailable(self.cuda_only)

    def check_problem(self, prob: Problem, device: str, opts: dict) -> None:
        """Raise :class:`Unavailable` if the system cannot run this problem (``no_varlen``, a varlen one)."""
        if self.no_varlen is not None and prob.seqlens is not None:
            raise Unavailable(self.no_varlen)

    def problem_note(self, prob: Problem) -> str:
        return self.note

    def prepare(self, inp: dict, prob: Problem) -> dict:
        """Native-layout copies of the inputs (not timed)."""
        return dict(inp)

    def forward(self, t: dict, prob: Problem):
        """o in the native layout, differentiable in t's leaves."""
        raise NotImplementedError

    def leaves(self, t: dict) -> list[str]:
        return ["q", "k", "v", "sinks"] if self.has_sink else ["q", "k", "v"]

    def to_bhsd(self, name: str, x: torch.Tensor, prob: Problem) -> torch.Tensor:
        """A result (o, dq, dk, dv, dsink) back in the layout of the reference: [B, H, S, D], or
        packed [total, H, D] for varlen."""
        return x

    def gate_outputs(self, inp: dict, prob: Problem, grads: bool) -> dict:
        """Forward (+ backward) once on fresh leaves: o (and dq, dk, dv, dsink with ``grads``) in the
        reference's layout. An extra entry ``"name@tag"`` (another run of the same tensor) is
        judged against the reference's ``name`` too."""
        t = self.prepare(inp, prob)
        names = self.leaves(t)
        for n in names:
            t[n] = t[n].detach().clone().requires_grad_(grads)
        o = self.forward(t, prob)
        got = {"o": self.to_bhsd("o", o.detach(), prob)}
        if grads:
            gr = torch.autograd.grad(o, [t[n] for n in names], t["do"].to(o.dtype))
            for n, x in zip(names, gr):
                key = "dsink" if n == "sinks" else "d" + n
                got[key] = self.to_bhsd(key, x, prob)
        return got

    def callables(self, inp: dict, prob: Problem) -> dict:
        """fwd, bwd, fwd+bwd closures on native-layout inputs (layout conversion not timed)."""
        t = self.prepare(inp, prob)
        names = self.leaves(t)
        for n in names:
            t[n] = t[n].detach().clone().requires_grad_(True)
        leaves = [t[n] for n in names]

        def fwd():
            with torch.no_grad():
                return self.forward(t, prob)

        def fwd_bwd():
            o = self.forward(t, prob)
            return torch.autograd.grad(o, leaves, t["do"].to(o.dtype))

        def train_step():  # fwd+bwd as a training step calls it (zero_grad(set_to_none=True) first)
            for x in leaves:
                x.grad = None
            o = self.forward(t, prob)
            o.backward(t["do"].to(o.dtype))

        state = {}

        def bwd():
            if "o" not in state:  # forward once, outside the timed region; backward replays its graph
                state["o"] = self.forward(t, prob)
            return torch.autograd.grad(state["o"], leaves, t["do"].to(state["o"].dtype), retain_graph=True)

        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd, "host:fwd+bwd": train_step}

    def release(self) -> None:
        """Drop what the system keeps between its gate and its timing (called after each problem)."""


def all_visible(prob: Problem) -> bool:
    """Every query row sees every key: no mask needed (decode: one row, bottom-right causal)."""
    return prob.seqlens is None and visible_pairs(prob.seq_q, prob.seq_kv, prob.window, prob.causal) == \
        prob.seq_q * prob.seq_kv



def callables_of(system: System, prob: Problem, inp: dict):
    """fwd, bwd, fwd+bwd closures (:meth:`System.callables`) and a state slot for the caller."""
    return system.callables(inp, prob), None
