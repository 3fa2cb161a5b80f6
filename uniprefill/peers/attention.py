"""The adapter: a peer's prefill kernel as a transformers attention function.

transformers 5 looks each attention layer's function up by `config._attn_implementation` in
its `AttentionInterface`. `PeerAttention` registers one function per peer setting under its own
name ("uniprefill_peer_<method>_<hash>", with SDPA's mask builder) and `PeerAttention.applied(model)`
switches the model to it for the length of a call (`model.set_attn_implementation`), then back.
So the model's own code runs unchanged: only the full-attention prefills go to the peer.

SDPA serves, and the counts say why, every call a peer's kernel was not written for:
- decode steps and any call with cached keys (queries fewer than keys);
- a mask (left padding, sliding windows, packed documents): the peers' kernels are causal over
  one unpadded sequence; SDPA's mask builder returns None exactly for plain causal batches;
- calls that are not causal (encoders, cross-attention, vision towers) or carry extra terms
  (position bias, attention sinks, packed-sequence lengths);
- sliding-window layers (the peers accelerate full attention), dropout, softcapping;
- prompts shorter than `PeerSpec.min_tokens` or than the method's own blocks need.
A peer that cannot run at all here (no `minference`, no CUDA, an unsupported head size)
raises `PeerUnavailable` at the first prefill, never a silent dense run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from .methods import PREFILL
from .spec import PeerSpec


@dataclass
class PeerCounts:
    """What the adapter did since the last `reset()`."""

    sparse_calls: int = 0
    density_sum: float = 0.0
    sdpa_reasons: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.sparse_calls, self.density_sum = 0, 0.0
        self.sdpa_reasons.clear()

    @property
    def density(self) -> float | None:
        """Mean density of the sparse calls (None: none ran)."""
        return self.density_sum / self.sparse_calls if self.sparse_calls else None

    def as_dict(self) -> dict:
        return {"sparse_calls": self.sparse_calls, "density": self.density,
                "sdpa_calls": dict(self.sdpa_reasons)}


# keyword arguments that change what attention computes beyond q, k, v, a causal mask and a scale:
# where one is set, SDPA (which honours it) serves the call
_EXTRA_TERMS = ("position_bias", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k", "alibi_slopes")


class PeerAttention:
    """One peer setting registered as a transformers attention function."""

    def __init__(self, spec: PeerSpec):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.spec = spec
        self.settings = spec.resolved
        self.counts = PeerCounts()
        # transformers' registries are process-wide: each PeerAttention registers under its own
        # name, so two systems of one setting in one process keep their own counts
        self.name = f"uniprefill_peer_{spec.method}_{spec.stable_hash()}_{id(self):x}"
        AttentionInterface.register(self.name, self.forward)
        AttentionMaskInterface.register(self.name, sdpa_mask)

    def _sdpa_reason(self, module, query, key, attention_mask, dropout, kwargs) -> str | None:
        if query.shape[2] != key.shape[2]:
            return "decode or cached keys"
        if attention_mask is not None:
            return "mask (padding, window or packing)"
        if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            return "not causal (encoder, cross-attention or vision tower)"
        if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
            return "sliding-window layer"
        if dropout or kwargs.get("softcap") is not None:
            return "dropout or softcap"
        if any(kwargs.get(name) is not None for name in _EXTRA_TERMS):
            return "extra attention terms (position bias, sinks or packed lengths)"
        if query.shape[2] < self.spec.min_tokens:
            return "shorter than min_tokens"
        return None

    def forward(self, module, query, key, value, attention_mask, dropout: float = 0.0,
                scaling: float | None = None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        reason = self._sdpa_reason(module, query, key, attention_mask, dropout, kwargs)
        if reason is None:
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            result = PREFILL[self.spec.method](query, key, value, scale, self.settings)
            if result is not None:
                out, density = result
                self.counts.sparse_calls += 1
                self.counts.density_sum += density
                return out.transpose(1, 2).contiguous(), None
            reason = "too short for the method's blocks"
        self.counts.sdpa_reasons[reason] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module):
        """Run `model` with this peer's attention inside the block, its own afterwards.

        Every config of the model (sub-models too: a vision tower's calls are not causal and go to
        SDPA) is switched, and each gets back exactly what it had."""
        configs = _attention_configs(model)
        before = {id(c): c._attn_implementation for c in configs}
        if model.config._attn_implementation not in ("sdpa", self.name):
            raise ValueError(f"the model runs {model.config._attn_implementation!r} attention; a peer "
                             "replaces SDPA attention only (load the model with attn_implementation='sdpa')")
        model.set_attn_implementation(self.name)
        try:
            if model.config._attn_implementation != self.name:
                raise ValueError(f"{type(model).__name__} does not let its attention be switched at run time "
                                 "(transformers' set_attn_implementation left it as it was)")
            yield model
        finally:
            for config in configs:
                config._attn_implementation_internal = before[id(config)]


def _attention_configs(model: torch.nn.Module) -> list:
    """The model's config and every sub-config that carries an attention implementation."""
    found, stack = {}, [model.config]
    stack += [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    while stack:
        config = stack.pop()
        if id(config) in found or not hasattr(config, "_attn_implementation"):
            continue
        found[id(config)] = config
        stack += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if getattr(config, key, None) is not None]
    return list(found.values())
