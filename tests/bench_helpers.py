"""What several tests/test_bench_*.py files share: a deliberately wrong system, a fake FA4 on the reference,
the tiny varlen and decode problems, and the CLI called in-process."""

from __future__ import annotations

import os
import sys

import torch

from flashsink import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Wrong(bench.Eager):
    """The reference with its output scaled by 1.05: passes no gate, is timed and says so."""

    name = "wrong"
    note = "deliberately wrong"
    calls = 0

    def forward(self, t, prob):
        type(self).calls += 1
        return super().forward(t, prob) * 1.05


def fake_fa4(monkeypatch, calls):
    """A `flash_attn.cute.interface` built on the reference, FA4's signatures and conventions: [B, S, H, D],
    window_size=(W - 1, 0), learnable_sink, (o, lse) returned; varlen on packed [total, H, D]."""
    import types

    from flashsink import reference

    def window(window_size, causal):
        left, right = window_size
        assert causal and right in (0, None)
        return None if left is None else left + 1

    def flash_attn_func(q, k, v, qv=None, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, return_lse=False, **kw):
        calls.append(("dense", q.shape))
        return reference.attention(q, k, v, learnable_sink, window=window(window_size, causal), scale=softmax_scale,
                                   causal=causal, layout="bshd", return_lse=True)

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                               learnable_sink=None, **kw):
        calls.append(("varlen", q.shape))
        assert cu_seqlens_q.dtype == torch.int32 and q.dim() == 3
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          learnable_sink, window=window(window_size, causal), scale=softmax_scale,
                                          causal=causal, return_lse=True)

    mods = {n: types.ModuleType(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")}
    mods["flash_attn.cute.interface"].flash_attn_func = flash_attn_func
    mods["flash_attn.cute.interface"].flash_attn_varlen_func = flash_attn_varlen_func
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)


def tiny_new_presets():
    return bench.preset_problems("varlen", tiny=True, dtype="fp32") + bench.preset_problems("decode", tiny=True,
                                                                                            dtype="fp32")


def bench_cli(*argv):
    from flashsink.cli import main

    return main(["bench", "--device", "cpu", *argv])
