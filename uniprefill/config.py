"""The one configuration object of uniprefill.

`UniPrefillConfig` is frozen and validated on construction: a bad value raises
`ValueError` naming the field, the value and the allowed range. Its field names are
also the keys of `torch.compile(..., backend="uniprefill", options={...})` and of the
vLLM `compilation_config` channel; `UniPrefillConfig.from_options` rejects unknown keys.
`stable_hash()` is a hex digest of every field, for compile caches that must never go stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

from .kernels.names import IMPLS, SELECTIONS

DropLayers = Union[Literal["auto", "all"], tuple[int, ...]]
KeepRatio = Union[None, float, tuple[float, ...]]

POLICIES = ("cumulative", "suspend")
# The rule of drop_layers="auto" (`passes.drop_points.auto_drop_layers`): 1 started every model at
# layer L // 4 - 1; 2 (from 2026-12-02) starts models whose every layer is full attention at
# L // 2 - 1. Enters the stable hash of "auto" configs, so records keyed by it never mix rules.
AUTO_RULE = 2
WINDOW_POSITIONS = ("original", "compacted")


@dataclasses.dataclass(frozen=True)
class UniPrefillConfig:
    """Settings of the score-and-select rewrite.

    Attributes:
        p: share of the (block-averaged, head-summed) attention score that the kept blocks
            must hold, in (0, 1]; `selection` says of which score. At p = 1 the rewrite stays
            in place, still scores, and keeps every token.
        selection: "content" (default: the blocks other than the sink and window must hold p
            of the score that falls outside the sink and window blocks; the forced blocks are
            kept on top) or "paper" (the paper's rule: the sink and window blocks, always
            kept, count toward p of all the score). Where the sink and window hold most of the
            score, as in the deep layers of small models, "paper" keeps little beyond them at
            any p < 1 (docs/selection.md). The defaults (content, p = 0.95, drop_layers "auto")
            were chosen from the H200 evals of docs/benchmarks.md ("Choosing the defaults");
            the paper's defaults are `p=0.99, selection="paper"`. Left unset with `keep_ratio`
            (which replaces top-p) it is "paper"; "content" with `keep_ratio` is refused.
        block_size: G, the number of consecutive tokens scored and kept or dropped
            together. >= 1.
        last_q: n, the number of final queries whose attention scores the keys. These
            last n tokens are always kept. >= 1.
        sink: A, the number of leading tokens that are always kept (attention sinks). >= 0.
        drop_layers: where tokens are dropped. A tuple of decoder-layer indices (as in
            `model.model.layers`), each of which must be a full-attention layer; "all" for
            every full-attention layer; "auto" for the rule in
            `uniprefill.passes.drop_points.auto_drop_layers`.
        policy: "cumulative" (a later drop point scores only the survivors; dropped tokens
            never return) or "suspend" (a dropped token keeps the hidden state it had when
            dropped, skips every layer up to the next drop point and re-enters there to be
            scored again; after the last drop point it stays out).
        keep_ratio: None to select by top-p; otherwise a float in (0, 1], or one float per
            drop point: keep that share of the tokens entering the drop point (sink and
            window included in the count), highest-scoring blocks first. `p` is then ignored.
        min_tokens: sequences shorter than this are never dropped from. Values below
            `sink + last_q` are raised to it (see `effective_min_tokens`).
        impl: "triton", "torch" (the PyTorch reference) or "auto" (Triton on CUDA tensors,
            the reference elsewhere). Chosen explicitly; never a silent fallback.
        window_positions: how a sliding-window layer after a drop point measures its window.
            "original" (default): key j is visible to query i when their ORIGINAL positions
            are less than the window apart, as in the unpruned model. "compacted": over the
            kept tokens' indices, i.e. the last `window` kept tokens, which is what the
            paper's released vLLM code computes and what a kernel with one uniform window
            over the packed tokens can express; an ablation, to measure what it costs.
        strict: raise instead of running a graph unaccelerated when it cannot be rewritten.
        debug: dump the graph before and after the rewrite to the logger `uniprefill.passes`
            at INFO (formatted only when that logger shows INFO: `logging.basicConfig(level=logging.INFO)`).
        vllm_drop: inside vLLM only (`uniprefill.vllm.plugin`): run the token-drop rewrite. Off,
            the engine runs unaccelerated with the reason logged (the rewrite is experimental:
            docs/vllm.md). Formerly the environment switch UNIPREFILL_VLLM_DROP=1.
        vllm_decode_graphs: inside vLLM only: with `cudagraph_mode="FULL_DECODE_ONLY"`, a dropping
            engine decodes under CUDA graphs that read each step's drop histories; without it that
            mode is refused when dropping. Formerly UNIPREFILL_VLLM_DECODE_GRAPHS=1.
        vllm_allow_untested: inside vLLM only: let a dropping engine start on a vLLM version other
            than the verified ones (the rewrite reads vLLM internals that may change). Formerly
            UNIPREFILL_VLLM_ALLOW_UNTESTED=1.
        vllm_context_drops: inside vLLM only: a request whose prompt starts in vLLM's KV cache (the
            last chunk of a chunked prefill, or a prefix-cache hit) drops among the tokens of that
            last prefill step: its last n queries score those tokens' keys, and the cached context
            stays whole at every layer. False: such requests run unaccelerated
            (`SkipReason.HAS_CONTEXT`). With sliding-window layers after a drop point, such a
            request drops only where its step drops at least `min(window - 1, context)` rows
            (`uniprefill.vllm.window`; else `SkipReason.CONTEXT_TAIL`).
        vllm_one_step_prefill: inside vLLM only: a dropping engine whose user gave no
            `max_num_batched_tokens` gets a step budget of `min(max_model_len, 32768) +
            max_num_seqs - 1`, so that a prompt of up to 32,768 tokens is prefilled, and drops, in
            one step instead of in vLLM's default chunks (`uniprefill.vllm.prefill_budget`, which
            says when the budget is left alone; logged). False: vLLM's budget.
        early_sparse_p: None (default) or a float in (0, 1]: every full-attention layer before
            the first drop point runs block-sparse attention instead of dense, over blocks of
            128 tokens: per head, the sink blocks, a local band of `early_sparse_window` tokens
            and the key blocks holding this share of the last `last_q` queries' attention to
            the blocks outside those (`uniprefill.kernels.sparse_attention`). Hugging Face
            backend only; padded batches and prompts shorter than `effective_min_tokens` run
            dense. An experiment of docs/sparse-prefill.md, off by default.
        early_sparse_keep: instead of `early_sparse_p`, a forced share in (0, 1] of those
            blocks (for speed runs on random weights, where top-p selects nearly every block).
        early_sparse_window: the local band of the sparse layers, in tokens (>= 0).
        The `vllm_*` fields travel in the same dict as the others
        (`compilation_config.inductor_compile_config["uniprefill"]`), so they enter vLLM's config
        hash and this config's digest; the Hugging Face backend ignores them.
    """

    p: float = 0.95
    block_size: int = 64
    last_q: int = 128
    sink: int = 128
    drop_layers: DropLayers = "auto"
    policy: Literal["cumulative", "suspend"] = "cumulative"
    keep_ratio: KeepRatio = None
    min_tokens: int = 0
    impl: Literal["auto", "triton", "torch"] = "auto"
    window_positions: Literal["original", "compacted"] = "original"
    strict: bool = False
    debug: bool = False
    # last: positional construction keeps its order. None (unset) becomes "content", or "paper"
    # with keep_ratio (which replaces top-p, so no rule applies; "paper" keeps the digest of such
    # configs as it was before the field existed)
    selection: Literal["paper", "content"] | None = None
    vllm_drop: bool = False
    vllm_decode_graphs: bool = False
    vllm_allow_untested: bool = False
    vllm_context_drops: bool = True
    vllm_one_step_prefill: bool = True
    early_sparse_p: float | None = None
    early_sparse_keep: float | None = None
    early_sparse_window: int = 1024

    def __post_init__(self) -> None:
        for name in ("p", "block_size", "last_q", "sink", "drop_layers", "keep_ratio", "min_tokens"):
            object.__setattr__(self, name, _plain(getattr(self, name)))  # numpy / torch scalars and arrays
        _check_number("p", self.p, low=0.0, low_open=True, high=1.0)
        _check_int("block_size", self.block_size, low=1)
        _check_int("last_q", self.last_q, low=1)
        _check_int("sink", self.sink, low=0)
        _check_int("min_tokens", self.min_tokens, low=0)
        object.__setattr__(self, "drop_layers", _normalise_drop_layers(self.drop_layers))
        object.__setattr__(self, "keep_ratio", _normalise_keep_ratio(self.keep_ratio))
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {POLICIES}")
        if self.selection is None:
            object.__setattr__(self, "selection", "content" if self.keep_ratio is None else "paper")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} is not one of {SELECTIONS}")
        if self.selection != "paper" and self.keep_ratio is not None:
            raise ValueError(f"selection={self.selection!r} chooses a top-p rule, but keep_ratio={self.keep_ratio} "
                             "replaces top-p; give one of them")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not one of {IMPLS}")
        if self.window_positions not in WINDOW_POSITIONS:
            raise ValueError(f"window_positions={self.window_positions!r} is not one of {WINDOW_POSITIONS}")
        for name in ("early_sparse_p", "early_sparse_keep"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), low=0.0, low_open=True, high=1.0)
        if self.early_sparse_p is not None and self.early_sparse_keep is not None:
            raise ValueError(f"early_sparse_p={self.early_sparse_p} and early_sparse_keep={self.early_sparse_keep}: "
                             "give one of them (top-p or a forced share)")
        _check_int("early_sparse_window", self.early_sparse_window, low=0)
        for name in ("strict", "debug", "vllm_drop", "vllm_decode_graphs", "vllm_allow_untested",
                     "vllm_context_drops", "vllm_one_step_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")

    @property
    def early_sparse(self) -> bool:
        """Whether the layers before the first drop point run block-sparse attention."""
        return self.early_sparse_p is not None or self.early_sparse_keep is not None

    @property
    def effective_min_tokens(self) -> int:
        """Shortest sequence that can be dropped from: never below sink + last_q."""
        return max(self.min_tokens, self.sink + self.last_q)

    def keep_ratio_at(self, drop_index: int, num_drop_points: int) -> float | None:
        """The forced keep ratio of the `drop_index`-th drop point, or None for top-p."""
        if self.keep_ratio is None:
            return None
        if len(self.keep_ratio) == 1:
            return self.keep_ratio[0]
        if len(self.keep_ratio) != num_drop_points:
            raise ValueError(
                f"keep_ratio has {len(self.keep_ratio)} values but the model has "
                f"{num_drop_points} drop points; give one value or one per drop point"
            )
        return self.keep_ratio[drop_index]

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "UniPrefillConfig":
        """Build from a `torch.compile` options dict; unknown keys raise `ValueError`."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown uniprefill option(s) {unknown}; the options are {sorted(known)}"
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("drop_layers", "keep_ratio"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out

    def stable_hash(self) -> str:
        """A digest of every field, stable across processes and Python versions.

        Fields added after results were first keyed by this digest (`_ADDED_LATER`) enter
        it only when they differ from their default, so earlier configs keep their digest
        and the eval records named by it stay valid.
        """
        data = self.to_dict()
        for name, default in _ADDED_LATER.items():
            if data[name] == default:
                del data[name]
        if self.drop_layers == "auto":
            data["auto_rule"] = AUTO_RULE
        blob = json.dumps(data, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_ADDED_LATER = {"window_positions": "original", "selection": "paper", "vllm_drop": False,
                "vllm_decode_graphs": False, "vllm_allow_untested": False, "vllm_context_drops": True,
                "vllm_one_step_prefill": True, "early_sparse_p": None, "early_sparse_keep": None,
                "early_sparse_window": 1024}


def _plain(value):
    """numpy or torch scalars and arrays as Python numbers and tuples (`np.int64(16)` is 16)."""
    if type(value).__module__ in ("numpy", "torch") and hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def _check_number(name, value, *, low, high, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name}={value!r} must be a number in {_range(low, high, low_open)}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        raise ValueError(f"{name}={value!r} is outside {_range(low, high, low_open)}")


def _range(low, high, low_open) -> str:
    return f"{'(' if low_open else '['}{low}, {high}]"


def _check_int(name, value, *, low) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}")


def _normalise_drop_layers(value) -> DropLayers:
    if value in ("auto", "all"):
        return value
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(
            f"drop_layers={value!r} must be 'auto', 'all' or a list of decoder-layer indices"
        )
    layers = tuple(value)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"drop_layers={value!r}: {layer!r} is not a layer index >= 0")
    if not layers:
        raise ValueError("drop_layers=[] names no layer; use p=1 to keep every token")
    if len(set(layers)) != len(layers):
        raise ValueError(f"drop_layers={value!r} repeats a layer")
    return tuple(sorted(layers))


def _normalise_keep_ratio(value) -> KeepRatio:
    if value is None:
        return None
    values = (value,) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"keep_ratio={value!r} must be None, a float or a list of floats")
    for ratio in values:
        _check_number("keep_ratio", ratio, low=0.0, low_open=True, high=1.0)
    return tuple(float(r) for r in values)
