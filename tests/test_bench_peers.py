"""bench/peers.py: the peers' plumbing on the CPU (FLA and FA4 faked on the reference, flex eager, SDPA's
head folding) and the reasons a peer gives when it cannot run."""

from __future__ import annotations

import sys

import pytest
import torch

from flashsink import bench

from bench_helpers import fake_fa4, tiny_new_presets

pytestmark = pytest.mark.l1


def test_sdpa_gradients_fold_expanded_heads():
    prob = bench.Problem("t", 1, 4, 2, 8, 8, 16, 4, "fp32")
    x = torch.arange(1 * 4 * 8 * 16, dtype=torch.float32).view(1, 4, 8, 16)
    folded = bench.Sdpa().to_bhsd("dk", x, prob)
    assert torch.equal(folded, x[:, 0::2] + x[:, 1::2])


def test_systems_that_cannot_run_say_why():
    varlen, _ = bench.preset_problems("varlen", tiny=True)
    dec = bench.preset_problems("decode", tiny=True)[0]
    with pytest.raises(bench.Unavailable, match="not varlen"):
        bench.Sdpa().check_problem(varlen, "cuda", {})
    bench.Sdpa().check_problem(dec, "cuda", {})  # sdpa runs decode (no mask needed: one row sees all)
    assert not bench.Sdpa()._dense(dec) and "no mask" in bench.Sdpa().problem_note(dec)
    with pytest.raises(bench.Unavailable, match="forward only"):
        bench.Fla().check_problem(dec, "cuda", {"grads": True})


def _fake_fla(monkeypatch):
    """An `fla` with parallel_attn / attn_decoding_one_step built on the reference, so the bench's
    FLA plumbing (layouts, cu_seqlens, decode packing) is checked on the CPU."""
    import types

    from flashsink import reference

    def parallel_attn(q, k, v, g=None, scale=None, window_size=None, cu_seqlens=None, chunk_indices=None, *,
                      sink_bias=None):
        if cu_seqlens is None:
            return reference.attention(q, k, v, sink_bias, window=window_size, scale=scale, layout="bshd")
        assert q.shape[0] == 1
        m = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return reference.attention_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, m, m, sink_bias,
                                          window=window_size, scale=scale)[None]

    def attn_decoding_one_step(q, k, v, g=None, scale=None, cu_seqlens=None, do_gate_scale=False, *,
                               sink_bias=None):
        cu = cu_seqlens.tolist()
        outs = [reference.attention(q[:, i:i + 1], k[:, cu[i]:cu[i + 1]], v[:, cu[i]:cu[i + 1]], sink_bias,
                                    scale=scale, layout="bshd") for i in range(len(cu) - 1)]
        return torch.cat(outs, 1)

    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.attn", "fla.ops.attn.parallel",
                                             "fla.ops.attn.decoding")}
    mods["fla.ops.attn.parallel"].parallel_attn = parallel_attn
    mods["fla.ops.attn.decoding"].attn_decoding_one_step = attn_decoding_one_step
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def test_fla_and_flex_plumbing_on_cpu(monkeypatch):
    """FLA (a fake one on the reference) and FlexAttention (eager, forward: flex has no CPU
    backward) pass the gate on the varlen and decode problems: their layouts round-trip."""
    _fake_fla(monkeypatch)

    class FlaCPU(bench.Fla):
        def check_available(self, device):
            pass

    class FlexCPU(bench.Flex):
        def __init__(self):
            super().__init__(compile=False)

        def check_available(self, device):
            pass

        def forward(self, t, prob):  # flex refuses CPU inputs that require grad, even under no_grad
            return super().forward({k: v.detach() if torch.is_tensor(v) else v for k, v in t.items()}, prob)

    monkeypatch.setitem(bench.SYSTEMS, "fla", FlaCPU)
    monkeypatch.setitem(bench.SYSTEMS, "flex", FlexCPU)
    probs = tiny_new_presets()
    timer = bench.Timer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench(probs, systems=["fla", "flex"], modes=["fwd"], device="cpu", timer=timer, gate2=False)
    for r in res["rows"]:
        assert r["status"] == "ok", r
    # FLA with gradients on varlen (the fake is differentiable); decode is forward only
    res = bench.run_bench(probs[:1], systems=["fla"], modes=list(bench.MODES), device="cpu", timer=timer,
                          gate2=False)
    assert all(r["status"] == "ok" for r in res["rows"]), res["rows"]


def test_fa4_plumbing_on_cpu(monkeypatch):
    """FA4 (a fake one on the reference): its layout, window and sink conventions round-trip through the
    gate on dense, varlen and decode problems, forward and backward."""
    calls = []
    fake_fa4(monkeypatch, calls)

    class Fa4CPU(bench.Fa4):
        def check_available(self, device):
            pass

    monkeypatch.setitem(bench.SYSTEMS, "fa4", Fa4CPU)
    probs = [bench.preset_problems("gptoss-swa", tiny=True)[0], *bench.preset_problems("varlen", tiny=True),
             bench.preset_problems("decode", tiny=True)[0]]
    res = bench.run_bench(probs, systems=["fa4"], modes=list(bench.MODES), device="cpu",
                          timer=bench.Timer("cpu", rep_ms=1.0, min_reps=1))
    for r in res["rows"]:
        if r["status"] != bench.FORWARD_ONLY:
            assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
    assert {c[0] for c in calls} == {"dense", "varlen"}
    assert ("dense", (1, 128, 4, 16)) in calls  # [B, S, H, D]
    with pytest.raises(bench.Unavailable, match="fp16 / bf16"):
        bench.Fa4().check_problem(bench.parse_shape("1,2,1,32,16", "fp32"), "cuda", {})
    with pytest.raises(bench.Unavailable, match="CUDA only"):
        bench.Fa4().check_available("cpu")


def test_fa4_listed_unavailable_without_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface", raising=False)
    with pytest.raises(bench.Unavailable, match="import flash_attn.cute.interface"):
        bench.Fa4().check_available("cuda")
