"""``flashsink.nn.SinkAttention``: a module holding the learnable sinks, for people writing their own models.

It holds no projections: it is the attention core (``softmax(q k^T * scale, sink) @ v``) of a layer,
like ``F.scaled_dot_product_attention`` with the sinks parameter attached. Bring your own q/k/v
projections, rotary embedding and output projection.

Initialisation of the sinks: the gpt-oss reference (openai/gpt-oss) allocates them with
``torch.empty(num_heads)`` and only ever loads them from a checkpoint; Hugging Face's
``GptOssAttention`` allocates ``nn.Parameter(torch.empty(config.num_attention_heads))`` and its
``GptOssPreTrainedModel._init_weights`` fills them with ``normal_(mean=0.0, std=config.initializer_range)``
(``initializer_range`` defaults to 0.02). We follow Hugging Face, the only published initialisation
for training from scratch: ``normal_(0, init_std)`` with ``init_std=0.02``. A sink logit near 0 starts
the sink with the weight of one key of score 0; it is learnt from there.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ._validate import check_tensor
from .api import attention, check_precision

__all__ = ["SinkAttention"]

_LAYOUTS = ("bhsd", "bshd")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class SinkAttention(nn.Module):
    """Attention with one learnable sink logit per query head (gpt-oss style), backed by ``flashsink.attention``.

    Args:
        num_heads: query heads H; ``sinks`` has shape ``[H]``.
        num_kv_heads: key/value heads (GQA: ``num_heads % num_kv_heads == 0``); default ``num_heads``.
        head_dim: D of q and k (and v).
        window: sliding window W (keys ``[i-W+1, i]``, needs ``causal=True``) or None.
        causal: causal mask, bottom-right aligned when ``S_q < S_kv`` (the KV-cache case).
        scale: score scale; default ``head_dim ** -0.5``.
        layout: ``"bhsd"`` (``[B, H, S, D]``) or ``"bshd"`` (``[B, S, H, D]``) for q, k, v and the output.
        init_std: standard deviation of the normal initialisation of the sinks (Hugging Face gpt-oss: 0.02).
        precision: ``"fast"`` (default) or ``"strict"``, as :func:`flashsink.attention` (CUDA only; the
            reference on other devices is exact either way). A plain attribute: it may be changed later.
        device, dtype: of the sinks parameter (keep it float32 for training; it may differ from q's dtype).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int = 64,
        *,
        window: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        layout: str = "bhsd",
        init_std: float = 0.02,
        precision: str = "fast",
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_heads = _positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads must divide num_heads (GQA groups), got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        head_dim = _positive_int("head_dim", head_dim)
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        if window is not None:
            window = _positive_int("window", window)
            if not causal:
                raise ValueError(f"window={window} needs causal=True (a sliding window is causal); got causal=False")
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (float(scale) > 0 and float(scale) < float("inf")):
                raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
            scale = float(scale)
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        if isinstance(init_std, bool) or not isinstance(init_std, numbers.Real) or not 0 <= float(init_std) < math.inf:
            raise ValueError(f"init_std must be a finite float >= 0, got {init_std!r}")
        check_precision(precision)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.causal = causal
        self.scale = scale
        self.layout = layout
        self.init_std = float(init_std)
        self.precision = precision
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Sinks ~ N(0, init_std^2), as Hugging Face's ``GptOssPreTrainedModel._init_weights``."""
        with torch.no_grad():
            self.sinks.normal_(mean=0.0, std=self.init_std)

    def _check_input(self, name: str, t, heads: int) -> None:
        check_tensor(name, t)  # flashsink.attention's own check first: a nested tensor has no shape to read
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor in layout {self.layout!r}, got {getattr(t, 'shape', type(t))}")
        h = t.shape[1] if self.layout == "bhsd" else t.shape[2]
        if h != heads:
            raise ValueError(
                f"{name} has {h} heads in layout {self.layout!r} (shape {tuple(t.shape)}), but the module was built with {heads}"
            )
        if name != "v" and t.shape[-1] != self.head_dim:
            raise ValueError(f"{name} has head dim {t.shape[-1]}, but the module was built with head_dim={self.head_dim}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False):
        """q ``[B, H, S_q, D]``, k/v ``[B, H_kv, S_kv, D]`` (or the ``"bshd"`` order); returns o in q's layout
        (and, with ``return_lse``, the float32 lse ``[B, H, S_q]`` including the sink)."""
        self._check_input("q", q, self.num_heads)
        self._check_input("k", k, self.num_kv_heads)
        self._check_input("v", v, self.num_kv_heads)
        sinks = self.sinks
        if sinks.device != q.device:
            raise ValueError(f"the module's sinks are on {sinks.device} but q is on {q.device}; move the module with .to()")
        return attention(
            q, k, v, sinks,
            window=self.window, causal=self.causal, scale=self.scale, layout=self.layout, return_lse=return_lse,
            precision=self.precision,
        )

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window={self.window}, causal={self.causal}, scale={self.scale}, layout={self.layout!r}, "
            f"precision={self.precision!r}"
        )
