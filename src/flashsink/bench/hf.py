"""The ``hf-train`` preset of ``flashsink bench``: a Hugging Face ``GptOssForCausalLM`` training step
with ``attn_implementation`` "sink_attention" (flashsink's; its rows are "hf/flashsink") against
"flex_attention" and "eager".

The model is built locally from a ``GptOssConfig`` with random weights (no download): gpt-oss's
attention shapes (64 query heads, 8 KV heads, head dim 64, sinks, layers alternating sliding 128 /
full), 2 layers, a small hidden size, vocabulary and expert count, so the step's time is mostly
attention. One step: ``zero_grad(set_to_none=True)``, ``loss = model(ids, labels=ids).loss``,
``loss.backward()`` (no optimizer: it would time the same for every implementation).

Gate: on a short sequence (``GATE_TOKENS``) of the same model, the logits of each implementation in
the bench dtype are judged against the model in float64 with eager attention; ``lowp`` is the model in
the bench dtype with eager attention. The logits pass through every later layer's rounding, so the
strict gate is the composed one (``check_precision(..., composed=True)``); the fast gate as everywhere.
The row's gate is the strongest passed; flashsink must pass the fast gate (its default precision).
Reported: step ms, tokens/s, peak memory (``torch.cuda.max_memory_allocated`` over the step, weights
and gradients included), flashsink's speedup over flex. An implementation that runs out of memory
(eager at 16k tokens: its [H, S, S] scores) is reported skipped with the reason.
"""

from __future__ import annotations

import copy
import time

import torch

from ..testing import check_fast, check_precision

# row label (the attn_implementation but flashsink's) -> the bench system name it answers to in --systems
IMPLEMENTATIONS = {"flashsink": "flashsink", "flex_attention": "flex", "eager": "eager"}
# flashsink's attn_implementation is flashsink.integrations.transformers.NAME (no "flash" in it: issue 52),
# named here without importing transformers; tests/test_integrations.py checks the two agree
ATTN_NAMES = {"flashsink": "sink_attention"}
GATE_TOKENS = 512
TINY_GATE_TOKENS = 48
SYSTEM_PREFIX = "hf/"


def model_config(prob, *, tiny: bool) -> dict:
    """GptOssConfig keywords: the problem's attention shapes, a small rest."""
    hidden = 64 if tiny else 1024
    return dict(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=hidden,
        num_attention_heads=prob.heads, num_key_value_heads=prob.kv_heads, head_dim=prob.head_dim,
        sliding_window=prob.window, layer_types=["sliding_attention", "full_attention"],
        vocab_size=128 if tiny else 1024, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=max(4096, prob.seq_q), pad_token_id=0, eos_token_id=1, bos_token_id=2,
        attn_implementation="eager", experts_implementation="eager",  # eager experts: they run in float64
    )


def unavailable(impl: str, device: str) -> str:
    """Why this implementation cannot run here ("" if it can)."""
    try:
        import transformers  # noqa: F401
        from transformers import GptOssForCausalLM  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: transformers with GptOss not importable ({type(exc).__name__}: {exc})"
    if impl == "flex_attention" and device != "cuda":
        return "unavailable: CUDA only (flex has no CPU backward)"
    return ""


def _build(prob, device: str, seed: int, tiny: bool):
    from transformers import GptOssConfig, GptOssForCausalLM

    import flashsink.integrations.transformers  # noqa: F401  (registers "sink_attention")

    torch.manual_seed(seed)
    return GptOssForCausalLM(GptOssConfig(**model_config(prob, tiny=tiny))).to(device=device)


def _with_impl(model, impl: str, dtype):
    m = copy.deepcopy(model).to(dtype)
    m.config._attn_implementation = ATTN_NAMES.get(impl, impl)
    return m


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.detach()


def _gate(model, impl: str, ids, expected, lowp, dtype) -> tuple[str, str, list]:
    """(gate label, failing text, reports) of this implementation's logits on the short sequence."""
    actual = _logits(_with_impl(model, impl, dtype), ids)
    strict = check_precision("logits", actual, expected, dtype, lowp=lowp, composed=True)
    fast = check_fast("logits", actual, expected, dtype, lowp=lowp)
    label = "strict" if strict.passed else "fast" if fast.passed else "none"
    fails = "; ".join(f"{r.gate}: {r.reason}" for r in (strict, fast) if not r.passed)
    return label, fails, [strict, fast]


def _is_oom(exc: Exception) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_problem(prob, systems: list[str], device: str, timer, seed: int, *, tiny: bool, say,
                timed: bool = True) -> tuple[list, list]:
    """Rows (one per implementation, mode "fwd+bwd") and gate records of the training-step problem;
    ``timed=False`` (fwd+bwd not among the modes asked for) lists them n/a."""
    dtype = prob.torch_dtype
    base = _build(prob, device, seed, tiny)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (1, prob.seq_q), generator=gen).to(device)
    gate_ids = ids[:, :min(prob.seq_q, TINY_GATE_TOKENS if tiny else GATE_TOKENS)]
    refs = None
    rows, gates = [], []

    def new_row(system: str, note: str) -> dict:
        row = {
            "preset": prob.preset, "problem": prob.label(), "N": prob.n, "mode": "fwd+bwd", "system": system,
            "kind": prob.kind, "window": prob.window, "note": note, "status": "", "gate": None, "gate_fails": "",
            "ms": None, "host_us": None, "tflops": None, "gbs": None, "floor_ms": None, "pct_floor": None,
            "peak_mib": None, "speedup": None, "flops": None, "bytes": None, "bound": "", "tokens_s": None,
        }
        rows.append(row)
        return row

    impls = {name: impl for impl, name in IMPLEMENTATIONS.items()}
    for name in systems:  # every system gets a row: the others say why they are not in this preset
        if name not in impls:
            new_row(name, "")["status"] = ("n/a: the training step compares attn_implementation "
                                           f"{' / '.join(IMPLEMENTATIONS)} (systems {', '.join(impls)})")
    for impl, system_name in IMPLEMENTATIONS.items():
        if system_name not in systems:
            continue
        row = new_row(SYSTEM_PREFIX + impl, f'attn_implementation="{ATTN_NAMES.get(impl, impl)}", one training step')
        why = unavailable(impl, device) if timed else "n/a: the training step is fwd+bwd (--mode fwd+bwd or all)"
        if why:
            row["status"] = why
            continue
        tag = f"[{prob.label()}] {row['system']}"
        model = None
        try:
            if refs is None:
                say(f"[{prob.label()}] gate references: the model in fp64 and {prob.dtype}, eager attention, "
                    f"{gate_ids.shape[1]} tokens ...")
                refs = (_logits(_with_impl(base, "eager", torch.float64), gate_ids),
                        _logits(_with_impl(base, "eager", dtype), gate_ids))
            say(f"{tag}: gate (logits on {gate_ids.shape[1]} tokens) ...")
            row["gate"], row["gate_fails"], reports = _gate(base, impl, gate_ids, *refs, dtype)
            gates.append({"problem": prob.label(), "system": row["system"], "error": "",
                          "reports": [r.__dict__.copy() for r in reports]})
            model = _with_impl(base, impl, dtype).train()

            def step():
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()

            say(f"{tag}: training step, {prob.seq_q} tokens (warm-up compiles) ...")
            t0 = time.perf_counter()
            step()
            step()
            say(f"{tag}: warm-up {time.perf_counter() - t0:.1f} s; timing ...")
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
            ms = timer(step)
        except Exception as exc:  # noqa: BLE001
            if _is_oom(exc):
                row["status"] = f"skipped: out of memory at {prob.seq_q} tokens ({str(exc).splitlines()[0][:120]})"
            else:
                row["status"] = f"FAIL: {type(exc).__name__}: {str(exc).strip()[:200]}"
        else:
            ok = row["gate"] in ("strict", "fast") or impl != "flashsink"
            row["status"] = "ok" if ok else "FAIL (fast gate): " + row["gate_fails"]
            row["ms"] = ms
            row["tokens_s"] = prob.seq_q / (ms * 1e-3)
        finally:
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    flex = next((r["ms"] for r in rows if r["system"] == SYSTEM_PREFIX + "flex_attention" and r["ms"]), None)
    for r in rows:
        if r["ms"] is not None and flex is not None:
            r["speedup"] = flex / r["ms"]
    return rows, gates
