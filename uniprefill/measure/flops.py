"""Analytic prefill FLOPs, with and without token dropping, and the ideal speedup.

Counted per decoder layer (multiply-add = 2 FLOPs), for one sequence:
- attention projections (q with Qwen3-Next's output gate, k, v, o) on the tokens entering;
- attention as it is computed: causal full attention skips the upper triangle (N^2 / 2
  query-key pairs, as SDPA's causal kernels do), while a sliding window runs as masked full
  attention under SDPA (N^2 pairs, nothing saved by the window);
- linear attention (Gated DeltaNet) as O(N): projections, short convolution, the chunked
  recurrence (state update and read-out per token plus the intra-chunk terms);
- MLP: gated (gate, up, down), or MoE: router, the active experts and the shared expert;
- the LM head for the one position that `logits_to_keep=1` keeps.
Norms, RoPE, residual adds and embeddings are left out (bandwidth, not FLOPs).

With dropping, a drop layer runs its attention on the tokens entering it (plus scoring:
the last `last_q` queries against every key) and its MLP and all later sublayers on the
kept tokens. "cumulative": tokens entering drop point j are those kept at j - 1.
"suspend": every token re-enters each drop point, so each one is entered by all N.
"""

from __future__ import annotations

from collections.abc import Sequence

_FULL, _SLIDING, _LINEAR = "full_attention", "sliding_attention", "linear_attention"


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    text = _text(config)
    types = getattr(text, "layer_types", None)
    return list(types) if types else [_FULL] * text.num_hidden_layers


def _attention_flops(text, kind: str, n_in: int) -> float:
    d = text.hidden_size
    if kind == _LINEAR:
        nk, nv = text.linear_num_key_heads, text.linear_num_value_heads
        dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
        conv_dim = 2 * nk * dk + nv * dv
        proj = d * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * d  # qkvz, ba, out
        chunk = 64
        core = nv * (4 * dk * dv + chunk * (dk + dv))
        return 2 * n_in * (proj + core) + 2 * n_in * conv_dim * text.linear_conv_kernel_dim
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or d // heads
    q_out = heads * head_dim * (2 if getattr(text, "model_type", "") == "qwen3_next" else 1)
    proj = d * (q_out + 2 * kv_heads * head_dim) + heads * head_dim * d
    pairs = n_in * n_in / 2 if kind == _FULL else n_in * n_in
    return 2 * n_in * proj + 4 * pairs * heads * head_dim  # QK^T and PV


def _mlp_flops(text, layer: int, n: int) -> float:
    d = text.hidden_size
    experts = getattr(text, "num_experts", 0) or 0
    step = getattr(text, "decoder_sparse_step", 1) or 1
    moe = experts > 0 and layer not in (getattr(text, "mlp_only_layers", None) or []) \
        and (layer + 1) % step == 0
    if not moe:
        return 2 * n * 3 * d * text.intermediate_size
    active = text.num_experts_per_tok * text.moe_intermediate_size
    shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
    return 2 * n * (3 * d * (active + shared) + d * experts + (d if shared else 0))


def prefill_flops(
    config,
    seq_len: int,
    retention_per_drop_point: Sequence[float] | float | None = None,
    drop_layers: Sequence[int] = (),
    *,
    policy: str = "cumulative",
    last_q: int = 128,
) -> float:
    """FLOPs of one prefill of `seq_len` tokens, with dropping at `drop_layers`.

    `retention_per_drop_point[j]` is the share of the tokens entering drop point j that are
    kept (the drop report's "retention"); a single float applies to every drop point.
    """
    text = _text(config)
    types = layer_types(config)
    drops = sorted(drop_layers)
    if isinstance(retention_per_drop_point, (int, float)):
        retention = [float(retention_per_drop_point)] * len(drops)
    else:
        retention = list(retention_per_drop_point or [])
    if len(retention) != len(drops):
        raise ValueError(
            f"{len(retention)} retention values for {len(drops)} drop layers {drops}")
    if policy not in ("cumulative", "suspend"):
        raise ValueError(f"policy={policy!r} is not 'cumulative' or 'suspend'")
    for layer in drops:
        if not 0 <= layer < len(types) or types[layer] != _FULL:
            raise ValueError(f"drop layer {layer} is not a full-attention layer of the model")
    kept_at = dict(zip(drops, retention))
    n = float(seq_len)
    total = 0.0
    for layer, kind in enumerate(types):
        n_in = n
        if layer in kept_at:
            if policy == "suspend":
                n_in = float(seq_len)
            heads = text.num_attention_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
            total += 2 * min(last_q, n_in) * n_in * heads * head_dim  # scoring QK^T
            n = n_in * kept_at[layer]
        total += _attention_flops(text, kind, n_in) + _mlp_flops(text, layer, n)
    return total + 2 * text.hidden_size * text.vocab_size


def flop_ratio(
    config,
    seq_len: int,
    retention_per_drop_point: Sequence[float] | float,
    drop_layers: Sequence[int],
    *,
    policy: str = "cumulative",
    last_q: int = 128,
) -> float:
    """Ideal prefill speedup: baseline FLOPs / FLOPs with dropping."""
    base = prefill_flops(config, seq_len)
    dropped = prefill_flops(config, seq_len, retention_per_drop_point, drop_layers,
                            policy=policy, last_q=last_q)
    return base / dropped
