"""Hugging Face transformers integration: ``attn_implementation="sink_attention"``.

Importing this module registers it (``register()`` is idempotent)::

    import flashsink.integrations.transformers  # registers "sink_attention"
    model = GptOssForCausalLM.from_pretrained(path, attn_implementation="sink_attention")

Tested with transformers 5.23.0 and 5.25.0 (the range pinned in ``pyproject.toml``, extra ``hf``),
against ``GptOssForCausalLM``'s own eager attention. It registers through transformers' public
``AttentionInterface`` / ``AttentionMaskInterface`` only.

The name. It was "flashsink" until issue 52, and that name cannot work without patching transformers:
transformers 5.x takes any ``attn_implementation`` containing "flash" for a FlashAttention kernel
(``is_flash_attention_requested``: ``"flash" in name``) when it builds a model or switches one, so gpt-oss
(which lists ``_compatible_flash_implementations``) swaps "flashsink" for a hub kernel before any code of
ours runs, and other models refuse it. So the old name is not registered, not even as a deprecated
alias: one that worked only through ``config._attn_implementation`` would be half a name.

What the attention function honours (the contract of ``GptOssAttention.forward``):

* q ``[B, H, S_q, D]``, k/v ``[B, H_kv, S_kv, D]`` (after the KV cache update); GQA is passed through to
  flashsink as is (no ``repeat_kv``). The output is ``[B, S_q, H, D]``, attention weights ``None``.
* ``s_aux`` (gpt-oss passes ``module.sinks`` under that name), or a ``sinks=`` keyword, or else the
  module's ``sinks`` attribute; ``scaling``; ``sliding_window`` (keys ``[i-W+1, i]``, the same as
  transformers' ``sliding_window_overlay``); ``module.is_causal`` (default True).
* S_q < S_kv (generate() with a cache): bottom-right causal alignment, which is what the cache gives.
* Masks. ``"sink_attention"`` is also registered in ``AttentionMaskInterface`` with
  :func:`sink_attention_mask` (transformers' FlashAttention mask builder, plus the static-cache case
  below), so the model hands us ``None`` (no padding) or the 2-D boolean padding mask ``[B, S_kv]``
  (True = real token), never a materialised 4-D mask. A 2-D mask is honoured exactly by unpadding to
  varlen (``flashsink.attention_varlen``) and padding back; padded query rows come back as zeros (eager
  gives them arbitrary values; the model ignores them). A mask shorter than S_kv (a static cache)
  slices k/v to its length, as transformers' FlashAttention path does.
  With a sliding window, the real tokens of each row must be one contiguous run (left or right
  padding): otherwise the window, which transformers counts in absolute positions, would span the holes
  differently once unpadded, so such masks raise ``NotImplementedError``.
* A user-supplied 4-D mask is accepted only when it *is* the plain causal (or sliding-causal) mask,
  bool or additive float; anything else raises ``NotImplementedError`` rather than being ignored.
* Packed sequences (batch 1, no mask, ``position_ids`` that restart), or ``cu_seq_lens_q/k`` keywords,
  run as varlen, as transformers' FlashAttention path does.
* ``precision`` ("fast", the default, or "strict"; see ``flashsink.attention``): per call as a keyword of
  the model's forward (``model(input_ids, precision="strict")``; transformers passes it down to the
  attention function), or for the whole model as ``model.config.flashsink_precision = "strict"``. The call's
  keyword wins. Off CUDA it changes nothing (the reference is exact in its compute dtype).
* ``dropout > 0`` (training with ``attention_dropout``) and ``softcap`` raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch

import flashsink

__all__ = ["NAME", "flashsink_attention_forward", "register", "sink_attention_mask"]

NAME = "sink_attention"  # no "flash" in it: see the module's docstring


def sink_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                        attention_mask: torch.Tensor | None = None, **kwargs):
    """The ``AttentionMaskInterface`` function: ``None`` or the 2-D padding mask, as transformers'
    ``flash_attention_mask`` gives FlashAttention.

    One case more: ``generate()`` drops an all-ones mask unless it thinks FlashAttention runs with a
    static cache, and a static cache's k/v are ``kv_length`` slots of which only the first
    ``q_offset + q_length`` are written. Without a mask the attention would align the queries with the
    last slots, so this gives back the all-ones mask of the written length, which slices k/v (the
    length is read on the host: a static cache keeps it in a tensor).
    """
    from transformers.masking_utils import flash_attention_mask

    if attention_mask is None:
        written = q_offset + q_length
        written = int(written) if isinstance(written, torch.Tensor) else written
        if written < kv_length:
            attention_mask = torch.ones(batch_size, written, dtype=torch.bool, device=kwargs.get("device"))
    return flash_attention_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register ``"sink_attention"`` with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``
    (their public ``register``). Idempotent: calling it again changes nothing."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, flashsink_attention_forward)
    AttentionMaskInterface.register(NAME, sink_attention_mask)


def _unsupported(msg: str):
    return NotImplementedError(f"flashsink attention (transformers): {msg}")


def _check_4d_mask(mask: torch.Tensor, seq_q: int, seq_kv: int, window, causal: bool) -> None:
    """Accept a 4-D mask only when it equals the plain (sliding-)causal mask; raise otherwise."""
    if mask.shape[-2:] != (seq_q, seq_kv):
        raise _unsupported(f"a 4-D attention_mask of shape {tuple(mask.shape)} does not match q/k lengths ({seq_q}, {seq_kv})")
    visible = flashsink.reference.visible_mask(seq_q, seq_kv, window=window, causal=causal, device=mask.device)
    if mask.dtype == torch.bool:
        ok = bool((mask == visible).all())
    elif mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2  # transformers uses finfo.min (or -inf)
        ok = bool(((mask == 0) | blocked).all()) and bool((~blocked == visible).all())
    else:
        ok = False
    if not ok:
        raise _unsupported(
            "an arbitrary 4-D attention_mask cannot be honoured (only padding masks and the plain causal/sliding "
            "mask are supported); pass the 2-D padding mask [batch, seq] instead"
        )


def _varlen(query, key, value, mask_q: torch.Tensor, mask_k: torch.Tensor, sinks, window, causal, scale, precision):
    """Unpad by boolean masks ``[B, S_q]`` / ``[B, S_kv]``, run varlen, pad back. Returns ``[B, S_q, H, D_v]``."""
    b, h, sq, _ = query.shape
    q = query.transpose(1, 2)[mask_q]  # [total_q, H, D]
    k = key.transpose(1, 2)[mask_k]  # [total_k, H_kv, D]
    v = value.transpose(1, 2)[mask_k]
    lens_q = mask_q.sum(dim=1, dtype=torch.int32)
    lens_k = mask_k.sum(dim=1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=query.device)
    cu_q = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    o = flashsink.attention_varlen(
        q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), sinks,
        window=window, causal=causal, scale=scale, precision=precision,
    )
    out = o.new_zeros(b, sq, h, o.shape[-1])
    out[mask_q] = o
    return out


def _varlen_cu(query, key, value, cu_q, cu_k, max_q, max_k, sinks, window, causal, scale, precision):
    """Packed batch of one row with given cumulative lengths. Returns ``[1, S, H, D_v]``."""
    q = query.transpose(1, 2)[0]
    k = key.transpose(1, 2)[0]
    v = value.transpose(1, 2)[0]
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_k is None:
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    o = flashsink.attention_varlen(q, k, v, cu_q, cu_k, int(max_q), int(max_k), sinks, window=window, causal=causal,
                                   scale=scale, precision=precision)
    return o.unsqueeze(0)


def _packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens of a packed row (batch 1) whose position ids restart; None when it is one sequence."""
    pid = position_ids.reshape(-1)
    if pid.numel() <= 1:
        return None
    starts = torch.ones_like(pid, dtype=torch.bool)
    starts[1:] = (pid[1:] - pid[:-1]) != 1  # the boundaries transformers' packed-sequence masks use
    if not bool(starts[1:].any()):
        return None
    idx = starts.nonzero().view(-1).to(torch.int32)
    end = torch.tensor([pid.numel()], dtype=torch.int32, device=pid.device)
    return torch.cat([idx, end])


def _precision(module, kwargs) -> str:
    """``precision=`` of the model call, else the model config's ``flashsink_precision``, else "fast"."""
    precision = kwargs.get("precision")
    if precision is None:
        precision = getattr(getattr(module, "config", None), "flashsink_precision", None)
    return flashsink.api.check_precision("fast" if precision is None else precision)


def flashsink_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
):
    """The ``AttentionInterface`` function: returns ``(attn_output [B, S_q, H, D], None)``."""
    if dropout:
        raise _unsupported(
            f"attention dropout ({dropout}) is not supported; set config.attention_dropout=0.0 or call model.eval()"
        )
    if softcap is not None:
        raise _unsupported(f"logit softcapping (softcap={softcap}) is not supported")
    if kwargs.get("output_attentions"):
        raise _unsupported("output_attentions=True needs the attention weights, which flashsink never materialises; use eager")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"expected q/k/v of shape [B, H, S, D]; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )

    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None:
        sinks = sinks.reshape(-1)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    window = None if sliding_window is None else int(sliding_window)
    precision = _precision(module, kwargs)
    sq, skv = query.shape[2], key.shape[2]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")

    if attention_mask is None:
        if cu_q is not None and cu_k is not None:
            if query.shape[0] != 1:
                raise _unsupported(f"cu_seq_lens_q/k need a packed batch of 1 row, got batch {query.shape[0]}")
            out = _varlen_cu(query, key, value, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"),
                             sinks, window, causal, scaling, precision)
            return out, None
        if position_ids is not None and query.shape[0] == 1 and sq == skv and sq > 1:
            cu = _packed_cu_seqlens(position_ids)
            if cu is not None:
                return _varlen_cu(query, key, value, cu, cu, None, None, sinks, window, causal, scaling,
                                  precision), None
        out = flashsink.attention(query, key, value, sinks, window=window, causal=causal, scale=scaling, layout="bhsd",
                                  precision=precision)
        return out.transpose(1, 2).contiguous(), None

    if not isinstance(attention_mask, torch.Tensor):
        raise _unsupported(f"attention_mask of type {type(attention_mask).__name__} (e.g. a flex BlockMask) is not supported")

    if attention_mask.dim() == 4:
        _check_4d_mask(attention_mask, sq, skv, window, causal)
        out = flashsink.attention(query, key, value, sinks, window=window, causal=causal, scale=scaling, layout="bhsd",
                                  precision=precision)
        return out.transpose(1, 2).contiguous(), None

    if attention_mask.dim() != 2:
        raise _unsupported(f"attention_mask must be None, a 2-D padding mask or a 4-D mask; got shape {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point():
        raise _unsupported("a 2-D float attention_mask is ambiguous; pass a bool/int padding mask (1 = token, 0 = padding)")
    mask = attention_mask
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise _unsupported("a 2-D integer attention_mask must hold only 0 (padding) and 1 (token)")
        mask = mask != 0
    if mask.shape[0] != query.shape[0]:
        raise ValueError(f"attention_mask batch {mask.shape[0]} != query batch {query.shape[0]}")
    lm = mask.shape[1]
    if lm > skv:
        raise ValueError(f"the 2-D attention_mask covers {lm} keys but there are only {skv}")
    if lm < skv:  # static cache: slots past the mask are unwritten
        key, value, skv = key[:, :, :lm], value[:, :, :lm], lm
    if sq > skv:
        raise ValueError(f"more queries ({sq}) than keys ({skv}) under a padding mask")
    if bool(mask.all()):
        out = flashsink.attention(query, key, value, sinks, window=window, causal=causal, scale=scaling, layout="bhsd",
                                  precision=precision)
        return out.transpose(1, 2).contiguous(), None
    if not causal:
        raise _unsupported("padding masks are supported for causal attention only")
    if window is not None:
        m = mask.to(torch.int8)
        runs = (m[:, 1:] > m[:, :-1]).sum(dim=1) + m[:, 0]  # number of contiguous runs of real tokens per row
        if bool((runs > 1).any()):
            raise _unsupported(
                "with a sliding window, each row's real tokens must be contiguous (left or right padding only); "
                "this mask has padding holes between tokens"
            )
    mask_q = mask[:, skv - sq:]  # queries are the last S_q key positions (bottom-right)
    out = _varlen(query, key, value, mask_q, mask, sinks, window, causal, scaling, precision)
    return out, None


try:  # importing the module registers, when transformers is there
    register()
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flashsink.integrations.transformers needs Hugging Face transformers: pip install 'flashsink[hf]'"
    ) from err
