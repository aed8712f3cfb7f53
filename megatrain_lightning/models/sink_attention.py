"""Attention with sinks (GPT-OSS) through `torch.nn.functional.scaled_dot_product_attention`.

GPT-OSS adds one learned logit per head, the sink, to every softmax row: a key that every query sees and whose
value is zero. Transformers runs it only in eager attention (which materialises the [B, H, T, T+1] scores and
their fp32 softmax: at 16 x 2048 tokens and 64 heads, 17 GB per layer and several passes over it) or flex
attention. This module registers `attn_implementation="fused_sinks"`, which is the same function exactly
(same softmax, same gradients, sinks included) as one call of SDPA, so the fused kernels run it:

- The sink becomes a real key. Head dim 64 grows to 72 (one column for the sink, seven of zeros: the fused
  kernels want multiples of 8). Queries get the head's sink logit in column 64, keys a zero there, and one key
  prepended at position 0, the same for every head, holds ``1 / scale`` in column 64 and zeros elsewhere; its
  score is then ``sink * (1 / scale) * scale = sink`` for every query, and its value row is zero. Keys sharing
  one query group keep sharing (grouped-query attention stays grouped: nothing is repeated).
- A causal row must see that key too. A zero query row is prepended as well, so the square causal mask over
  T + 1 positions lets query t + 1 see the sink and keys 0..t; that row's output is dropped (its gradient is
  zero). The plain causal case keeps SDPA's `is_causal` fast path (flash / cuDNN on a GPU).
- Any other mask (sliding windows, packed rows, padding) is the boolean mask Transformers' own `sdpa_mask`
  builds, given one more column (the sink: always seen) and row; SDPA's masked kernel runs it, on all heads.

Cost against plain SDPA: 72 / 64 of the attention FLOPs, and one copy of q, k and v into the wider layout.
The gradient of the sink logit flows through the query column that holds it. `tests/test_sink_attention.py`
checks logits and every gradient against eager attention on tiny GPT-OSS models (full, sliding window, packed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "fused_sinks"  # transformers checks any name containing "sdpa" against the model's _supports_sdpa
_ALIGN = 8  # the fused SDPA kernels take head dims in multiples of 8
CHUNK_SLIDING = True  # sliding-window layers in chunks (_local); False: one masked call over all keys


def _pad_head(x: torch.Tensor, width: int) -> torch.Tensor:
    """[..., D] -> [..., width]: zeros after the head dim."""
    return F.pad(x, (0, width - x.shape[-1]))


def fused_sinks_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool from transformers' sdpa_mask, or None: plain causal
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,  # [Hq]: the sink logits
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation='{NAME}' returns no attention weights: use 'eager' for output_attentions")
    if dropout:
        raise ValueError(f"attn_implementation='{NAME}' runs without attention dropout (GPT-OSS trains with none): "
                         f"set config.attention_dropout=0 or use 'eager'")
    batch, heads, t_q, dim = query.shape
    s_kv = key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    if attention_mask is None:
        if t_q != s_kv:
            raise ValueError(f"attn_implementation='{NAME}' trains without a KV cache: query length {t_q} != key "
                             f"length {s_kv}")
        if sliding_window is not None and sliding_window < s_kv:
            # sdpa_mask leaves the mask out only where the window covers the sequence: a caller passing none
            # for a shorter window would get full attention, silently
            raise ValueError(f"attn_implementation='{NAME}': layer {getattr(module, 'layer_idx', '?')} has a "
                             f"{sliding_window}-token sliding window but got no attention mask for {s_kv} tokens")
        if not getattr(module, "is_causal", True):
            raise ValueError(f"attn_implementation='{NAME}' is for causal attention")
    elif attention_mask.dtype != torch.bool:
        raise ValueError(f"attn_implementation='{NAME}' takes boolean masks (transformers' sdpa_mask); got "
                         f"{attention_mask.dtype}")
    if s_aux is None:  # a model without sinks: transformers' own SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    width = -(-(dim + 1) // _ALIGN) * _ALIGN  # D + the sink column, rounded up: 64 -> 72
    sinks = s_aux.to(query.dtype)
    groups = heads // key.shape[1]
    if (CHUNK_SLIDING and attention_mask is not None and sliding_window is not None and t_q == s_kv
            and s_kv > 2 * sliding_window):
        return _local(query, key, value, attention_mask, sinks, scale, width, sliding_window, groups)

    # q: [B, Hq, T, D] -> [B, Hq, 1 + T, W]; column D holds the head's sink logit, row 0 is the dropped query
    sink_col = sinks.view(1, heads, 1, 1).expand(batch, heads, t_q, 1)
    q = _pad_head(torch.cat([query, sink_col], dim=-1), width)
    q = F.pad(q, (0, 0, 1, 0))
    # k: [B, Hkv, S, D] -> [B, Hkv, 1 + S, W]; key 0 is the sink (1 / scale in column D), others 0 there
    k = F.pad(_pad_head(key, width), (0, 0, 1, 0))
    k[:, :, 0, dim] = 1.0 / scale
    v = F.pad(_pad_head(value, width), (0, 0, 1, 0))  # the sink's value row is zero

    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    else:
        # [B, 1, T, S] -> [B, 1, 1 + T, 1 + S]: column 0 (the sink) seen by every row; row 0 sees only it
        mask = F.pad(attention_mask, (1, 0, 1, 0), value=False)
        mask[..., :, 0] = True
        if groups > 1:  # the masked kernels take no grouped heads: repeat k and v as transformers' sdpa does
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out[:, :, 1:, :dim]  # [B, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None  # [B, T, Hq, D], as transformers' attention functions return


def _local(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
           scale: float, width: int, window: int, groups: int) -> tuple[torch.Tensor, None]:
    """A sliding-window layer in chunks of C = window queries, each against the 2C keys that can reach it.

    Query t sees keys t - window + 1 .. t (transformers' sliding mask), so the queries of chunk j
    (jC .. jC + C - 1) need keys jC - C .. jC + C - 1 at most: 2C + 1 scores a query (the sink included) instead
    of T + 1, the attention FLOPs cut by T / 2C (16 x at 2048 tokens and a 128-token window). What counts of
    the mask is its band within those keys, as in transformers' flash-attention path, which takes the window
    alone: every mask transformers builds for a sliding layer is inside it."""
    batch, heads, t, dim = query.shape
    c = window
    n = -(-t // c)  # chunks
    pad = n * c - t
    sink_col = sinks.view(1, heads, 1, 1).expand(batch, heads, t, 1)
    # q: [B, Hq, T, D] -> [B * n, Hq, C, W]
    q = F.pad(_pad_head(torch.cat([query, sink_col], dim=-1), width), (0, 0, 0, pad))
    q = q.view(batch, heads, n, c, width).transpose(1, 2).reshape(batch * n, heads, c, width)

    def windows(x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, T, D] -> [B * n, Hkv, 1 + 2C, W]: chunk j's keys jC - C .. jC + C - 1, after one sink row."""
        x = F.pad(_pad_head(x, width), (0, 0, c, pad))  # C rows before the first key: chunk 0's "previous chunk"
        x = x.unfold(2, 2 * c, c)  # [B, Hkv, n, W, 2C] (a view)
        x = x.permute(0, 2, 1, 4, 3).reshape(batch * n, x.shape[1], 2 * c, width)
        return F.pad(x, (0, 0, 1, 0))

    k, v = windows(key), windows(value)
    k[:, :, 0, query.shape[-1]] = 1.0 / scale  # the sink key; its value row stays zero
    if groups > 1:  # the masked kernels take no grouped heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    # mask: [B, 1, T, T] -> [B * n, 1, C, 1 + 2C]: rows jC + r, columns jC - C + c (padded: C columns before)
    m = F.pad(mask, (c, pad, 0, pad), value=False).contiguous()  # [B, 1, nC, C + nC]
    row = m.stride(2)
    band = m.as_strided((batch, n, c, 2 * c), (m.stride(0), c * (row + 1), row, 1))
    band = F.pad(band, (1, 0), value=True).reshape(batch * n, 1, c, 1 + 2 * c)  # the sink: seen by every row
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale)  # [B * n, Hq, C, W]
    out = out.view(batch, n, heads, c, width).transpose(1, 2).reshape(batch, heads, n * c, width)
    return out[:, :, :t, :dim].transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="fused_sinks"` known to transformers (attention and its masks: SDPA's)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, fused_sinks_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # transformers < 4.53 builds masks by implementation name elsewhere
        return
    AttentionMaskInterface.register(NAME, sdpa_mask)
