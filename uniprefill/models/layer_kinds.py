"""What each decoder layer of a model mixes tokens with: the `LayerKind` vocabulary, and its one
derivation from a config.

`LayerKind` is the one vocabulary of layer kinds: the config derivation here, the graph
classification of the passes (`passes/classify.py`), the drop points, the reports and the vLLM
plugin all use it. Its members are strings ("full", "sliding", "linear", "other"), so they print,
compare and serialise as those words.

`layer_kinds(config)` is the one derivation of layer kinds from a config, used by the Hugging Face backend (to check
`drop_layers` before tracing), the presets and fuzzer, and the vLLM plugin (from vLLM's Hugging
Face text config). The graph passes classify the layers they trace (`passes/classify.py`) with
the same kind names; what they find is what the rewrite acts on.

uniprefill drops tokens only at full-attention layers; the other kinds decide what a later
layer must do with the kept tokens. The kind is read from the config alone, so it can be
known before a model is built:

- `config.layer_types` when the architecture has it (Gemma 3, Qwen3-Next, Qwen3.5, LFM2,
  GraniteMoeHybrid, OLMo 3, Cohere 2, GPT-OSS, ...; Jamba derives it from its periods).
  "full_attention" (legacy "attention") is "full"; "sliding_attention" is "sliding";
  "linear_attention" and the legacy "mamba" and "conv" are "linear": every recurrent or
  convolutional mixer whose state runs along the sequence (Gated DeltaNet, Mamba 1/2, LFM2's
  short convolution). transformers itself files these three under "linear_attention".
- otherwise every layer is "sliding" if the config turns on a sliding window for all layers
  (Mistral-style `sliding_window`, honouring Qwen2-style `use_sliding_window`), else "full".

Layer types this module does not know (chunked attention, parallel attention+SSM "hybrid"
layers, ...) are "other": never a drop point, and never guessed to be one of the three.
A `layer_types` list whose length differs from the layer count raises `ValueError`.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["LAYER_KINDS", "LayerKind", "layer_kinds"]


class LayerKind(str, enum.Enum):
    """What a decoder layer mixes tokens with (see the module docstring)."""

    FULL = "full"  # causal softmax attention over every earlier token: a possible drop point
    SLIDING = "sliding"  # causal attention over a window of earlier tokens
    LINEAR = "linear"  # a recurrent or convolutional mixer whose state runs along the sequence
    OTHER = "other"  # anything else: never a drop point, left as it is

    def __str__(self) -> str:  # "full", not "LayerKind.FULL", in messages and f-strings
        return self.value

    def __repr__(self) -> str:  # and 'full' in the lists of kinds that messages print
        return repr(self.value)


LAYER_KINDS = tuple(LayerKind)

_KIND_OF_LAYER_TYPE = {
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.LINEAR,
    "mamba": LayerKind.LINEAR,
    "conv": LayerKind.LINEAR,
}


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def layer_kinds(config: Any, num_layers: int | None = None) -> list[LayerKind]:
    """One `LayerKind` per decoder layer of `config` (a transformers config);
    `num_layers` defaults to `config.num_hidden_layers`."""
    config = _text_config(config)
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        sliding = getattr(config, "sliding_window", None) is not None and getattr(
            config, "use_sliding_window", True
        )
        return [LayerKind.SLIDING if sliding else LayerKind.FULL] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries for {num_layers} hidden layers"
        )
    return [_KIND_OF_LAYER_TYPE.get(t, LayerKind.OTHER) for t in layer_types]
