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


class PeerAttention:
    """One peer setting registered as a transformers attention function."""

    def __init__(self, spec: PeerSpec):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.spec = spec
        self.settings = spec.resolved
        self.counts = PeerCounts()
        self.name = f"uniprefill_peer_{spec.method}_{spec.stable_hash()}"
        # transformers' registries are process-wide; the name is this setting's own, and the
        # latest PeerAttention of a setting owns it (its counts are the ones updated)
        AttentionInterface.register(self.name, self.forward)
        AttentionMaskInterface.register(self.name, sdpa_mask)

    def _sdpa_reason(self, module, query, key, attention_mask, dropout, kwargs) -> str | None:
        if query.shape[2] != key.shape[2]:
            return "decode or cached keys"
        if attention_mask is not None:
            return "mask (padding, window or packing)"
        if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
            return "sliding-window layer"
        if dropout or kwargs.get("softcap") is not None:
            return "dropout or softcap"
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
        """Run `model` with this peer's attention inside the block, its own afterwards."""
        previous = model.config._attn_implementation
        if previous not in ("sdpa", self.name):
            raise ValueError(f"the model runs {previous!r} attention; a peer replaces SDPA attention "
                             "only (load the model with attn_implementation='sdpa')")
        model.set_attn_implementation(self.name)
        try:
            yield model
        finally:
            model.set_attn_implementation(previous)
