"""bench/hf.py: the `hf-train` preset, a GptOss training step per attn_implementation."""

from __future__ import annotations

import pytest
import torch

from flashsink import bench

pytestmark = pytest.mark.l1


def test_hf_train_preset_on_cpu(monkeypatch):
    """The GptOss training step: flashsink and eager gated (logits) and timed with tokens/s, flex listed
    unavailable off CUDA, and an implementation that runs out of memory reported skipped with the reason."""
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    from flashsink.bench import hf as bench_hf

    (prob,) = bench.preset_problems("hf-train", tiny=True, dtype="fp32")
    assert prob.kind == "hf-train" and "GptOssForCausalLM" in prob.label()
    (full,) = bench.preset_problems("hf-train")
    assert (full.heads, full.kv_heads, full.head_dim, full.window, full.seq_q, full.dtype) == (64, 8, 64, 128, 16384,
                                                                                               "bf16")
    real = bench_hf._with_impl

    def eager_oom_when_long(model, impl, dtype):
        m = real(model, impl, dtype)
        forward = m.forward

        def fwd(*args, input_ids=None, **kw):
            if impl == "eager" and input_ids.shape[1] > bench_hf.TINY_GATE_TOKENS:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
            return forward(*args, input_ids=input_ids, **kw)

        m.forward = fwd
        return m

    timer = bench.Timer("cpu", rep_ms=1.0, min_reps=1)
    res = bench.run_bench([prob], systems=["flashsink", "flex", "eager"], modes=list(bench.MODES), device="cpu",
                          timer=timer)
    rows = {r["system"]: r for r in res["rows"]}
    assert set(rows) == {"hf/flashsink", "hf/flex_attention", "hf/eager"}
    for name in ("hf/flashsink", "hf/eager"):
        r = rows[name]
        assert r["status"] == "ok" and r["gate"] == "strict" and r["ms"] > 0, r
        assert r["tokens_s"] == pytest.approx(prob.seq_q / (r["ms"] * 1e-3))
    assert rows["hf/flex_attention"]["status"].startswith("unavailable: CUDA only")
    assert {g["system"] for g in res["gates"]} == {"hf/flashsink", "hf/eager"}
    assert "tokens/s" in bench.format_table(res)

    monkeypatch.setattr(bench_hf, "_with_impl", eager_oom_when_long)
    res = bench.run_bench([prob], systems=["flashsink", "eager"], modes=["fwd+bwd"], device="cpu", timer=timer)
    rows = {r["system"]: r for r in res["rows"]}
    assert rows["hf/eager"]["status"].startswith("skipped: out of memory at 96 tokens") and rows["hf/eager"]["ms"] is None
    assert rows["hf/flashsink"]["status"] == "ok"
    res = bench.run_bench([prob], systems=["flashsink"], modes=["fwd"], device="cpu", timer=timer)
    assert res["rows"][0]["status"].startswith("n/a: the training step is fwd+bwd")
