"""Which census rows have a full-attention layer, and the accelerated share among them.

The share counts causal decoders only: a run row whose plain model fails the causality probe
(`census_causal.py`: earlier outputs change with later tokens) is outside the denominator too.

The issue's target is a share of the decoder-only types "with at least one full-attention layer":
a type without one (a state-space or recurrent model with no attention, or a config whose every
attention layer is sliding-window) has nothing for the method to score, so it is outside the
denominator. Each row says which it is and on what evidence:

- the graph: the pass found a full-attention layer (an accelerated row always has one);
- the family: a short list of attention-free model types (their mixers are not attention);
- the config: the layer pattern (`layer_types`, `layers_block_type`, `block_types`, GPT-Neo's
  `attention_layers`) names a full/global layer, or names only sliding / local / linear /
  recurrent / convolutional layers; without a pattern, a sliding window that is switched on
  (`sliding_window`, `attention_window_size`) makes every attention layer sliding.
A pattern entry the lists below do not know (e.g. `indexed_attention`, `compressed_sparse_attention`:
sparse attention over the whole prefix) counts as full, so the denominator errs on the large side.
"""

from __future__ import annotations

# attention-free token mixers: no layer computes attention over the tokens
ATTENTION_FREE = {
    "falcon_mamba": "Mamba selective scan",
    "mamba": "Mamba selective scan",
    "mamba2": "Mamba-2 state-space scan",
    "rwkv": "RWKV time mixing",
    "xlstm": "xLSTM recurrent cells",
}
_FULL = ("full", "global", "indexed", "sparse", "compressed")  # named for their global range
_GENERIC = ("attention", "hybrid")  # full unless the config switches a window on (RecurrentGemma's local attention)
_NOT_FULL = ("sliding", "local", "chunk", "linear", "mamba", "conv", "recurrent", "ssm", "mlp", "moe")
_PATTERNS = ("layer_types", "layers_block_type", "block_types", "attention_layers")
IN_SHARE = ("accelerated", "unaccelerated", "error", "mismatch")


def _kind_is_full(kind: str, window) -> bool | None:
    kind = str(kind).lower()
    if any(m in kind for m in _NOT_FULL):
        return False
    if any(m in kind for m in _FULL):
        return True
    if any(m in kind for m in _GENERIC):
        return not window
    return None


def _window(config) -> tuple[str, int] | None:
    for key in ("sliding_window", "attention_window_size"):
        window = vars(config).get(key)
        if window and vars(config).get("use_sliding_window", True) is not False:
            return key, window
    return None


def full_attention(model_type: str, config, layer_kinds: str = "") -> tuple[bool | None, str]:
    """(whether `model_type` with `config` has a full-attention layer, the evidence in words)."""
    if model_type in ATTENTION_FREE:
        return False, f"no attention layer ({ATTENTION_FREE[model_type]})"
    if "full" in layer_kinds.split():
        return True, "graph"
    if config is None:
        return None, ""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    window = _window(config)
    for key in _PATTERNS:
        try:  # a property on some configs (Jamba's layers_block_type)
            pattern = getattr(config, key, None)
        except Exception:  # noqa: BLE001  (a per-layer attribute that refuses global access)
            pattern = None
        if isinstance(pattern, (list, tuple)) and pattern and all(isinstance(k, str) for k in pattern):
            if any(_kind_is_full(k, window) is not False for k in pattern):
                return True, f"config ({key})"
            kinds = "/".join(sorted(set(pattern)))
            return False, f"every layer in {key} is {kinds}" + (f" ({window[0]}={window[1]})" if window else "")
    if window:
        return False, f"every attention layer is sliding-window ({window[0]}={window[1]})"
    return True, "config (attention layers, no window, no layer pattern)"


def accelerated_share(rows) -> tuple[int, int]:
    """(accelerated, denominator): rows whose status is accelerated, unaccelerated, error or mismatch,
    whose type has a full-attention layer and is a causal decoder (unknown counts in, for either, so the
    share is never overstated)."""
    counted = [r for r in rows if r.status in IN_SHARE and r.full_attention is not False
               and r.causal is not False]
    return sum(r.status == "accelerated" for r in counted), len(counted)


def share_line(rows) -> str:
    accelerated, total = accelerated_share(rows)
    percent = f"{100 * accelerated / total:.0f}%" if total else "n/a"
    outside = sum(r.status in IN_SHARE and r.full_attention is False for r in rows)
    not_causal = sum(r.status in IN_SHARE and r.full_attention is not False and r.causal is False
                     for r in rows)
    return (f"Accelerated share: {accelerated} of {total} ({percent}): the accelerated, unaccelerated, error and "
            f"mismatch rows of causal decoders with a full-attention layer (columns \"full attention\" and "
            f"\"causal\"); {outside} run rows without one (attention-free, or every attention layer "
            f"sliding-window) and {not_causal} run rows that are not causal decoders (their earlier outputs "
            "change with later tokens) are outside it.")
