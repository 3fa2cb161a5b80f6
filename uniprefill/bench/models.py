"""Loading the model under test from a name: the default model, a preset, or a local path.

- "gemma-3-270m" (the default): `uniprefill.models.gemma.load_gemma3_270m`, with tokenizer.
- a preset name ("llama-3.1-8b", "tiny-llama", ...): random weights from
  `uniprefill.models.presets.build_random_model`; a tokenizer only if one is named.
- a local folder: `AutoModelForCausalLM.from_pretrained`, tokenizer from the same folder
  (or the one named) when it has one.
The loaders of `uniprefill.models` are imported only when asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_MODEL = "gemma-3-270m"
_DEFAULT_ALIASES = (DEFAULT_MODEL, "gemma3-270m", "default")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any | None
    name: str
    source: str  # "default", "preset" or "path"


def model_source(spec: str) -> str:
    """"default", "path" or "preset"; `ValueError` for a path that does not exist."""
    if spec in _DEFAULT_ALIASES:
        return "default"
    if os.path.isdir(spec):
        return "path"
    if os.sep in spec or spec.startswith((".", "~")) or os.path.exists(spec):
        raise ValueError(f"model path {spec!r} does not exist (or is not a model folder)")
    return "preset"


# The default model's context (Gemma-3-270M: 32K), known without converting or loading it.
_DEFAULT_MAX_POSITIONS = 32768


def local_config(spec: str):
    """The model's config without loading weights: a local folder's, a preset's, or (for the
    default model) one that holds only its context length; None when unknown."""
    source = model_source(spec)
    if source == "path":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec)
    if source == "default":
        from types import SimpleNamespace

        return SimpleNamespace(max_position_embeddings=_DEFAULT_MAX_POSITIONS)
    from uniprefill.models.presets import PRESETS, preset_config

    return preset_config(spec) if spec in PRESETS else None


def max_positions(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def check_lengths(config, lengths, what: str = "length") -> None:
    """`ValueError` if a length exceeds the model's `max_position_embeddings`."""
    limit = max_positions(config) if config is not None else None
    if limit is None:
        return
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise ValueError(
            f"{what} {too_long} above the model's max_position_embeddings={limit}"
        )


def load_model(
    spec: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: str | None = None,
    num_layers: int | None = None,
) -> LoadedModel:
    source = model_source(spec)
    tok = None
    if source == "default":
        from uniprefill.models.gemma import load_gemma3_270m

        model, tok = load_gemma3_270m(dtype, device)
    elif source == "preset":
        try:
            from uniprefill.models import presets
        except ImportError as err:
            raise ValueError(f"model {spec!r}: the presets module is not available ({err})")
        model = presets.build_random_model(spec, dtype, device, num_layers=num_layers)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device)
        if tokenizer is None and os.path.exists(os.path.join(spec, "tokenizer_config.json")):
            tokenizer = spec
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    return LoadedModel(model.eval(), tok, spec, source)
