"""An independent, slow, obviously-correct eager reference of token dropping (tests and the fuzzer).

It runs a Hugging Face Llama, Gemma-3, GPT-OSS, Qwen3-Next or Qwen3.5 model sublayer by sublayer with plain calls
to its modules: every layer runs on the current set of tokens, with RoPE at their ORIGINAL
positions and a mask built from those positions (causal, and windowed for sliding layers;
additive for GPT-OSS, whose eager attention adds it to the logits beside its sinks, and for any model
on eager attention); a Gated DeltaNet layer (Qwen3-Next, Qwen3.5) runs its module on the current tokens
as one sequence, in order: its convolution and recurrence see the kept tokens only, one after the other;
at a drop layer the attention runs on all current tokens, then the residual stream is cut
to the given kept positions before the MLP. Only the indices are shared with the rewrite (the Gated DeltaNet
module's PyTorch scan, which `uniprefill.compat` routes through uniprefill's op process-wide once a model is
compiled, computes what transformers' own does). Other model families refuse: their layers are built otherwise
(Gemma-2's extra norms and soft caps, Olmo3's norm order), and a reference that ran them anyway would be wrong.
"""

from __future__ import annotations

import torch

SUPPORTED = frozenset({"llama", "gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5_text"})


def _mask(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    diff = pos[:, None] - pos[None, :]
    allowed = diff >= 0
    if window:
        allowed &= diff < window
    return allowed[None, None]


def _rotary(model, h, pos, layer_type):
    rot = model.model.rotary_emb
    if getattr(model.config, "model_type", "") == "gemma3_text":
        return rot(h, pos[None], layer_type)
    if hasattr(rot, "mrope_section"):  # Qwen3.5's multimodal RoPE: text positions on all three axes (5.17 needs 3-D)
        return rot(h, pos[None, None].expand(3, 1, -1))
    return rot(h, pos[None])


def reference_last_logits(model, ids: torch.Tensor, kept: dict[int, torch.Tensor],
                          window_positions: str = "original") -> torch.Tensor:
    """Logits of the last token of a single-row prompt, with drops after layer L to `kept[L]`.

    `kept[L]` holds ORIGINAL positions (sorted) kept at drop layer L (cumulative policy).
    `window_positions="compacted"`: sliding windows count live tokens instead of original
    positions (RoPE keeps the original positions either way).
    """
    assert ids.shape[0] == 1
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"the eager reference models {sorted(SUPPORTED)}, not {cfg.model_type!r}")
    gemma = cfg.model_type == "gemma3_text"
    additive = cfg.model_type == "gpt_oss" or getattr(cfg, "_attn_implementation", None) == "eager"
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(model.model.layers)
    h = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])
    for idx, layer in enumerate(model.model.layers):
        layer_type = layer_types[idx]
        attn_in = layer.input_layernorm(h)
        if layer_type == "linear_attention":  # Gated DeltaNet over the live tokens as one sequence
            attn_out = layer.linear_attn(hidden_states=attn_in)
        else:
            window = cfg.sliding_window if layer_type == "sliding_attention" else None
            cos_sin = _rotary(model, h, pos, layer_type)
            mask_pos = torch.arange(pos.numel()) if window_positions == "compacted" else pos
            mask = _mask(mask_pos, window)
            if additive:
                mask = torch.zeros(mask.shape, dtype=h.dtype).masked_fill(~mask, torch.finfo(h.dtype).min)
            attn_out, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=cos_sin, attention_mask=mask)
        if gemma:
            attn_out = layer.post_attention_layernorm(attn_out)
        h = h + attn_out
        if idx in kept:
            take = torch.searchsorted(pos, kept[idx])
            assert torch.equal(pos[take], kept[idx]), "kept positions must be a subset of the live ones"
            h, pos = h[:, take], kept[idx]
        if gemma:
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        else:
            mlp_out = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)  # GPT-OSS: (out, router scores)
    h = model.model.norm(h)
    logits = model.lm_head(h[:, -1:])
    if getattr(cfg, "final_logit_softcapping", None):
        cap = cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits[:, -1]


def dropped_run(model, ids: torch.Tensor, config) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
    """(last-token logits of `uniprefill.compile(model, config)` on the single-row `ids`, the ORIGINAL
    positions kept at each drop layer (for a reference such as `reference_last_logits`), the plain
    model's last-token logits). Resets dynamo afterwards."""
    import uniprefill

    assert ids.shape[0] == 1
    with torch.no_grad():
        fast = uniprefill.compile(model, config)
        out = fast(input_ids=ids, use_cache=False).logits[:, -1]
        history = uniprefill.last_drop_report(fast)
        kept = {p.layer: p.kept_positions(0, ids.shape[1]) for p in history.points} if history is not None else {}
        full = model(input_ids=ids, use_cache=False).logits[:, -1]
    torch._dynamo.reset()
    return out, kept, full
