"""The peers flashsink is timed against (the fp32 reference, SDPA, FlexAttention, FLA, FA4; cuDNN in
:mod:`.cudnn_peer`), and
:data:`SYSTEMS`, the registry of every row in table order."""

from __future__ import annotations

import importlib
import inspect

import torch

from .cudnn_peer import Cudnn
from .flashsink_systems import (FlashSink, FlashSinkDet, FlashSinkGraph, FlashSinkKVCache, FlashSinkPaged,
                                FlashSinkStrict, FlashSinkStrictGraph)
from .problems import score_elems
from .system import System, Unavailable, all_visible


class Eager(System):
    name = "eager"
    note = "fp32 reference"

    def check_problem(self, prob, device, opts):
        # The reference materialises [B, H, Sq, Skv] float32 scores (per sequence for varlen);
        # forward+backward keeps about eight such tensors alive (scores, mask result, exp, P, and
        # their gradients).
        need = 8 * 4 * score_elems(prob)
        budget = opts.get("eager_max_gib", 48.0) * 2**30
        if need > budget:
            raise Unavailable(f"skipped: needs ~{need / 2**30:.0f} GiB of fp32 scores "
                              f"(> --eager-max-gib {budget / 2**30:g})")

    def forward(self, t, prob):
        from .. import reference

        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            return reference.attention_varlen(t["q"], t["k"], t["v"], cu, cu, m, m, t["sinks"], window=prob.window,
                                              causal=prob.causal, scale=prob.scale)
        return reference.attention(t["q"], t["k"], t["v"], t["sinks"], window=prob.window,
                                   causal=prob.causal, scale=prob.scale)


class Sdpa(System):
    name = "sdpa"
    has_sink = False
    note = "no sink"
    cuda_only = "CUDA only in the bench"
    no_varlen = ("n/a: SDPA is not varlen (no cu_seqlens); padding to the longest sequence or a block-diagonal "
                 "mask over all tokens would time other work")

    def _dense(self, prob) -> bool:
        if all_visible(prob):
            return False
        return prob.window is not None or (prob.causal and prob.seq_q != prob.seq_kv)

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return "no sink"
        if self._dense(prob):
            return "no sink; dense bool mask, K/V expanded: computes all Sq*Skv pairs"
        if prob.causal and all_visible(prob) and prob.seq_q < prob.seq_kv:
            return "no sink; no mask (one query row sees the whole cache)"
        return "no sink"

    def prepare(self, inp, prob):
        t = dict(inp)
        t["is_causal"] = prob.causal and not all_visible(prob)  # decided here: forward is timed
        g = prob.heads // prob.kv_heads
        if self._dense(prob):
            from ..reference import visible_mask

            t["mask"] = visible_mask(prob.seq_q, prob.seq_kv, window=prob.window, causal=prob.causal,
                                     device=inp["q"].device)
            # A masked call with enable_gqa falls back to the math backend; expanded K/V keep the
            # memory-efficient kernel. The expansion is not timed.
            if g > 1:
                t["k"] = inp["k"].repeat_interleave(g, dim=1)
                t["v"] = inp["v"].repeat_interleave(g, dim=1)
        return t

    def forward(self, t, prob):
        import torch.nn.functional as F

        if "mask" in t:
            return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"], scale=prob.scale)
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=t["is_causal"],
                                              scale=prob.scale, enable_gqa=prob.heads != prob.kv_heads)

    def to_bhsd(self, name, x, prob):
        g = prob.heads // prob.kv_heads
        if name in ("dk", "dv") and x.shape[1] == prob.heads and g > 1:
            b, _, s, d = x.shape
            return x.view(b, prob.kv_heads, g, s, d).sum(2)
        return x


class Flex(System):
    """torch FlexAttention with the sink applied through its LSE.

    Without the sink, flex gives ``o0 = sum_j e^{s_j} v_j / Z`` and ``lse = log Z``. With it,
    ``o = sum_j e^{s_j} v_j / (Z + e^{sink}) = o0 * Z / (Z + e^{sink}) = o0 * sigmoid(lse - sink)``.
    Gradients reach the sink, and q / k through the lse, by autograd. Varlen runs as one packed
    sequence [1, H, total, D] with a document mask (same sequence, causal / window within it).
    """

    name = "flex"
    peer = True
    note = "o*sigmoid(lse-sink), torch.compile"

    def __init__(self, compile: bool = True):
        self.compile = compile
        self._fn = None

    def check_available(self, device):
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"torch.nn.attention.flex_attention not importable: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (flex has no CPU backward)")

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return self.note + "; document mask over the packed batch"
        return self.note

    def _build(self):
        from torch.nn.attention.flex_attention import flex_attention

        use_aux = "return_aux" in inspect.signature(flex_attention).parameters
        if use_aux:
            from torch.nn.attention.flex_attention import AuxRequest

        def flex_sink(q, k, v, sinks, block_mask, scale, gqa):
            if use_aux:
                o, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                        return_aux=AuxRequest(lse=True))
                lse = aux.lse
            else:
                o, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                        return_lse=True)
            factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
            return (o.float() * factor.unsqueeze(-1)).to(q.dtype)

        if not self.compile:
            return flex_sink
        # One graph per problem shape (dynamic=False: static shapes, as a tuned layer would run).
        # The bench runs a dozen shapes through this one function; past dynamo's recompile limit
        # (8) it would silently fall back to eager flex, so raise the limit.
        import torch._dynamo as dynamo  # (a plain `import torch._dynamo` would make torch local here)

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(256, getattr(dynamo.config, knob)))
        # The bwd-only rows replay one forward's graph (retain_graph=True, System.callables), which a
        # backward compiled with donated buffers refuses ("requires create_graph=False and
        # retain_graph=False"): every flex bwd row errored so. The flag is read when AOTAutograd
        # compiles (first call), so it is set here, for the bench's process.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        return torch.compile(flex_sink, dynamic=False)

    def prepare(self, inp, prob):
        from torch.nn.attention.flex_attention import create_block_mask

        w, causal = prob.window, prob.causal
        t = dict(inp)
        if prob.seqlens is not None:
            # packed [total, H, D] -> [1, H, total, D]; doc[i] = the sequence of token i
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(0, 1).unsqueeze(0).contiguous()
            dev = inp["q"].device
            doc = torch.repeat_interleave(torch.arange(len(prob.seqlens), device=dev),
                                          torch.tensor(prob.seqlens, device=dev))

            def doc_mask(b, h, q_idx, kv_idx):
                keep = doc[q_idx] == doc[kv_idx]  # q and k/v share the packing: positions line up
                if causal:
                    keep = keep & (kv_idx <= q_idx)
                if w is not None:
                    keep = keep & (q_idx - kv_idx < w)
                return keep

            total = prob.tokens_q
            t["block_mask"] = create_block_mask(doc_mask, None, None, total, total, device=dev)
            return t

        off = prob.seq_kv - prob.seq_q

        def mask_mod(b, h, q_idx, kv_idx):
            i = q_idx + off
            keep = (kv_idx <= i) if causal else (kv_idx >= 0)
            if w is not None:
                keep = keep & (i - kv_idx < w)
            return keep

        if all_visible(prob):  # decode: nothing to mask
            t["block_mask"] = None
        else:
            t["block_mask"] = create_block_mask(mask_mod, None, None, prob.seq_q, prob.seq_kv,
                                                device=inp["q"].device)
        return t

    def forward(self, t, prob):
        if self._fn is None:
            self._fn = self._build()
        return self._fn(t["q"], t["k"], t["v"], t["sinks"], t["block_mask"], prob.scale,
                        prob.heads != prob.kv_heads)

    def to_bhsd(self, name, x, prob):
        if prob.seqlens is not None and name in ("o", "dq", "dk", "dv"):
            return x[0].transpose(0, 1)  # [1, H, total, D] -> [total, H, D]
        return x


class Fla(System):
    """flash-linear-attention's softmax attention (Triton, [B, T, H, D] layout, causal only):
    ``fla.ops.attn.parallel.parallel_attn(..., sink_bias=)`` for T_q = T_k, varlen through its
    ``cu_seqlens`` (the packed batch as B = 1); decode through
    ``fla.ops.attn.decoding.attn_decoding_one_step(..., sink_bias=)`` (forward only)."""

    name = "fla"
    peer = True
    note = "parallel_attn(sink_bias=), bshd"

    def check_available(self, device):
        try:
            importlib.import_module("fla.ops.attn.parallel")
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"`import fla.ops.attn.parallel` failed: {type(exc).__name__}: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (Triton)")

    @staticmethod
    def _params(module: str, fn: str) -> set[str] | None:
        try:
            return set(inspect.signature(getattr(importlib.import_module(module), fn)).parameters)
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def _is_decode(prob) -> bool:
        return prob.seqlens is None and prob.seq_q == 1 < prob.seq_kv

    def problem_note(self, prob):
        if self._is_decode(prob):
            return "attn_decoding_one_step(sink_bias=), forward only"
        if prob.seqlens is not None:
            return "parallel_attn(cu_seqlens=, sink_bias=), packed B=1"
        return self.note

    def check_problem(self, prob, device, opts):
        if not prob.causal:
            raise Unavailable("n/a: parallel_attn is causal only")
        if self._is_decode(prob):
            if opts.get("grads"):
                raise Unavailable("n/a: fla's decoding kernel is forward only (run --mode fwd)")
            params = self._params("fla.ops.attn.decoding", "attn_decoding_one_step")
            if params is None or "sink_bias" not in params:
                raise Unavailable("n/a: this fla has no fla.ops.attn.decoding.attn_decoding_one_step(sink_bias=)")
            if prob.window is not None and prob.window < prob.seq_kv:
                raise Unavailable("n/a: fla's decoding kernel has no window")
            return
        params = self._params("fla.ops.attn.parallel", "parallel_attn")
        if params is not None and "sink_bias" not in params:
            raise Unavailable("n/a: this fla's parallel_attn has no sink_bias")
        if prob.seqlens is not None:
            if params is not None and "cu_seqlens" not in params:
                raise Unavailable("n/a: this fla's parallel_attn has no cu_seqlens")
            return
        if prob.seq_q != prob.seq_kv:
            raise Unavailable("n/a: parallel_attn needs seq_q == seq_kv")

    def prepare(self, inp, prob):
        t = dict(inp)
        if prob.seqlens is not None:  # [total, H, D] -> [1, total, H, D]
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].unsqueeze(0)
            t["cu_seqlens"] = inp["cu_seqlens"].long()
        elif self._is_decode(prob):  # q [1, B, H, D]; the caches packed [1, B*N, H_kv, D]
            b, n = prob.batch, prob.seq_kv
            t["q"] = inp["q"].transpose(1, 2).reshape(1, b, prob.heads, prob.head_dim).contiguous()
            for x in ("k", "v"):
                t[x] = inp[x].transpose(1, 2).reshape(1, b * n, prob.kv_heads, inp[x].shape[-1]).contiguous()
            t["do"] = inp["do"].transpose(1, 2).reshape(1, b, prob.heads, -1).contiguous()
            t["cu_seqlens"] = torch.arange(0, (b + 1) * n, n, dtype=torch.long, device=inp["q"].device)
        else:
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(1, 2).contiguous()
        return t

    def forward(self, t, prob):
        if self._is_decode(prob):
            from fla.ops.attn.decoding import attn_decoding_one_step

            return attn_decoding_one_step(t["q"], t["k"], t["v"], scale=prob.scale, cu_seqlens=t["cu_seqlens"],
                                          sink_bias=t["sinks"])
        from fla.ops.attn.parallel import parallel_attn

        if prob.seqlens is not None:
            return parallel_attn(t["q"], t["k"], t["v"], scale=prob.scale, window_size=prob.window,
                                 cu_seqlens=t["cu_seqlens"], sink_bias=t["sinks"])
        return parallel_attn(t["q"], t["k"], t["v"], scale=prob.scale, window_size=prob.window,
                             sink_bias=t["sinks"])

    def to_bhsd(self, name, x, prob):
        if name not in ("o", "dq", "dk", "dv"):
            return x
        if prob.seqlens is not None:
            return x[0]  # [1, total, H, D] -> [total, H, D]
        if self._is_decode(prob):
            return x[0].unsqueeze(2)  # [1, B, H, D] -> [B, H, 1, D]
        return x.transpose(1, 2)


class Fa4(System):
    """FlashAttention-4 (``flash_attn.cute``, CuTe DSL; Hopper and Blackwell) with its learnable sink:
    ``flash_attn_func(q, k, v, softmax_scale=, causal=, window_size=(W - 1, 0), learnable_sink=)`` on
    [B, S, H, D] (its layout; decode is S_q = 1 against the cache, bottom-right aligned as ours), and
    ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, ...)``
    on the packed [total, H, D] batch. It returns (o, lse); o is judged. Every configuration compiles
    at its first call (5-15 s): the gate's, and each mode's first call, outside the timing."""

    name = "fa4"
    peer = True
    note = "flash_attn.cute flash_attn_func(learnable_sink=), bshd"
    MODULE = "flash_attn.cute.interface"

    def __init__(self):
        self._fns: dict = {}

    def _fn(self, name: str):
        if name not in self._fns:
            self._fns[name] = getattr(importlib.import_module(self.MODULE), name)
        return self._fns[name]

    def check_available(self, device):
        try:
            importlib.import_module(self.MODULE)
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"`import {self.MODULE}` failed: {type(exc).__name__}: {exc}") from None
        if device != "cuda":
            raise Unavailable("CUDA only (CuTe DSL kernels)")

    def check_problem(self, prob, device, opts):
        if prob.dtype not in ("fp16", "bf16"):
            raise Unavailable(f"n/a: FA4 takes fp16 / bf16 inputs, not {prob.dtype}")
        if prob.seqlens is not None and not hasattr(importlib.import_module(self.MODULE), "flash_attn_varlen_func"):
            raise Unavailable(f"n/a: this {self.MODULE} has no flash_attn_varlen_func")

    def problem_note(self, prob):
        if prob.seqlens is not None:
            return "flash_attn_varlen_func(cu_seqlens_q/k=, learnable_sink=), packed"
        return self.note

    def prepare(self, inp, prob):
        t = dict(inp)
        if prob.seqlens is None:  # [B, H, S, D] -> [B, S, H, D]
            for n in ("q", "k", "v", "do"):
                t[n] = inp[n].transpose(1, 2).contiguous()
        return t

    def forward(self, t, prob):
        kw = dict(softmax_scale=prob.scale, causal=prob.causal, learnable_sink=t["sinks"],
                  window_size=(None, None) if prob.window is None else (prob.window - 1, 0))
        if prob.seqlens is not None:
            cu, m = t["cu_seqlens"], t["max_seqlen"]
            out = self._fn("flash_attn_varlen_func")(t["q"], t["k"], t["v"], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=m, max_seqlen_k=m, **kw)
        else:
            out = self._fn("flash_attn_func")(t["q"], t["k"], t["v"], **kw)
        return out[0] if isinstance(out, (tuple, list)) else out  # (o, lse)

    def to_bhsd(self, name, x, prob):
        if prob.seqlens is None and name in ("o", "dq", "dk", "dv"):
            return x.transpose(1, 2)
        return x


# The registry, in table order. Tests may add entries (a deliberately wrong system).
SYSTEMS: dict[str, type] = {"flashsink": FlashSink, "flashsink-graph": FlashSinkGraph,
                            "flashsink-strict": FlashSinkStrict, "flashsink-strict-graph": FlashSinkStrictGraph,
                            "flashsink-det": FlashSinkDet,
                            "flashsink-kvcache": FlashSinkKVCache, "flashsink-paged": FlashSinkPaged,
                            "fa4": Fa4, "cudnn": Cudnn, "flex": Flex, "fla": Fla, "sdpa": Sdpa, "eager": Eager}
