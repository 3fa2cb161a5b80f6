"""Architecture census: every causal LM type of the installed transformers, tiny and random.

For each model type that maps to a causal-LM class and is a decoder-only text model, a tiny
random config is built by a generic shrinker (common size fields set small, sub-configs shrunk
alike, `layer_types` cut to the new depth, a sliding window shortened only where the default config
has one, so the tiny model keeps the default's kind of attention), plus a few per-family settings
in `_FAMILY` (none in the pass), and then:

(a) p = 1 prefill equals the plain model, one row and a left-padded batch of two;
(b) p = 1 greedy generation equals the plain model's;
(c) forced retention (`keep_ratio=0.5` at every full-attention layer) drops tokens (the drop
    report says so) and gives finite logits;
(e) the prompt (300 tokens) is longer than the chunk of every PyTorch fallback we know (64);
(f) the causality probe (`census_causal.py`): the plain model's logits before the middle of the prompt
    must not change when every later token does, or the type is not a causal decoder.

Each type ends as `accelerated`, `unaccelerated` (with the backend's reason), `mismatch`,
`error` or `skipped` (not a decoder-only text model, or no tiny config could be built, with
the reason). Each run row also says whether the type has a full-attention layer
(`census_attention.py`) and whether it is causal (f); the table states the accelerated share among the
causal types that have one.
`uniprefill census` runs it and writes the table (`docs/architectures.md`).
"""

from __future__ import annotations

import inspect
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field

import torch

from ..unaccelerated import Kind, kind_of
from .census_attention import full_attention, share_line
from .census_causal import causal_cell, causal_probe

SETTINGS = dict(sink=16, last_q=16, block_size=16)
_WINDOW = 24  # a sliding window shorter than the prompt, set only where the default config has one
_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16, mamba_headdim=16, mamba_n_groups=1, mamba_expand=2,
              ssm_state_size=8, state_size=8, n_groups=1, conv_kernel=4, time_step_rank=8, expand=2,
              attention_chunk_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              use_cache=True,
              # the same sizes under the older names some configs use
              n_embd=64, d_model=64, n_layer=4, n_layers=4, num_layers=4, n_head=4, n_heads=4, num_heads=4,
              n_inner=128, ffn_dim=128, d_ff=128, n_positions=4096, max_seq_len=4096, seq_length=4096,
              # rarer size fields: MoE experts, per-layer embeddings, byte-level (BLT) hash tables
              ffn_hidden_size=128, expert_ffn_hidden_size=32, shared_experts_intermediate_size=32,
              router_hidden_size=32, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
              hidden_size_global=64, encoder_hash_byte_group_vocab=128, local_attention_window_len=_WINDOW)
# counts that must not exceed the tiny expert count: lowered to these, never raised, never set where unset
# (expert groups for group-limited routing; experts per token and zero-computation experts of LongCat)
_AT_MOST = dict(n_group=1, num_expert_group=1, topk_group=1, moe_topk=2, zero_expert_num=2)
_MAX_PARAMETERS = 20_000_000  # a config the shrinker could not make small is skipped, not built
_LENGTH = 300


@dataclass
class CensusRow:
    model_type: str
    status: str  # accelerated, unaccelerated, mismatch, error, skipped
    reason: str = ""
    layer_kinds: str = ""
    generation: str = ""
    dropped: str = ""
    seconds: float = 0.0
    checks: dict = field(default_factory=dict)
    full_attention: bool | None = None  # has a full-attention layer (census_attention.py); None: not run
    full_attention_basis: str = ""  # the evidence: "graph", "config (...)", or why there is none
    causal: bool | None = None  # earlier outputs independent of later tokens (census_causal.py); None: not run


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _not_decoder_only(model_type: str, config) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder (masked LM) that can also be run as a decoder"
    declared = getattr(config, "sub_configs", None) or {}
    for key in ("vision_config", "audio_config", "speech_config", "depth_decoder_config"):
        if getattr(config, key, None) is not None or key in declared:
            return f"multimodal ({key}); its text model is censused under its own type where it has one"
    return _FAMILY.get(model_type, {}).get("skip", "")


def tiny_config(model_type: str):
    """A tiny random config of `model_type` (generic shrinking of the common fields)."""
    from transformers import AutoConfig

    family = _FAMILY.get(model_type, {})
    return _shrink(AutoConfig.for_model(model_type), family.get("tiny", {}))


# Per-family settings the generic shrinker cannot infer, each with why. "default": passed when building the
# type's default config; "tiny": set on the tiny config last.
_FAMILY = {
    # a drafter for speculative decoding: its forward needs the target model's embeddings and key/value states
    "gemma4_assistant": dict(skip="a drafter (assistant) model: its forward needs the target model's inputs_embeds "
                                  "and shared_kv_states, it does not run on token ids alone"),
    "gemma4_unified_assistant": dict(skip="a drafter (assistant) model: its forward needs the target model's "
                                          "inputs_embeds and shared_kv_states, it does not run on token ids alone"),
    # the per-layer-type RoPE table is empty by default and the model reads the "full_attention" entry
    "cohere_compass_text": dict(tiny=dict(rope_parameters={"full_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0}})),
    # transformers' attention reads attn_config.rope_theta, which the default attention sub-config lacks, and
    # clamps q/k/v with clip_qkv, which fails at its default None
    "dbrx": dict(tiny=dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0))),
    # sliding layers take their sizes from swa_* fields (defaults of the released checkpoint, 64 heads of 256)
    "dots3_note_text": dict(tiny=dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,
                                      swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8,
                                      swa_v_head_dim=16)),
    # no default layer pattern: the modeling code reads layer_types (convolution / attention per layer)
    "lfm2_moe": dict(tiny=dict(layer_types=["conv", "full_attention", "conv", "full_attention"])),
    # Mamba-2 checks hidden_size * expand == num_heads * head_dim
    "mamba2": dict(tiny=dict(num_heads=8)),
    # the indexed (QSA) attention's sizes have no defaults; the indexer needs one key/value head
    "qwen4_exp_text": dict(tiny=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                     indexer_budget=64, indexer_compress_ratio=4)),
    # the config validator allows one expert per token only
    "zaya": dict(tiny=dict(num_experts_per_tok=1)),
    # BertGenerationDecoder is a causal LM only with is_decoder=True (its default config builds a bidirectional
    # encoder, and transformers warns standalone users to set it)
    "bert-generation": dict(tiny=dict(is_decoder=True)),
}


def _uses_window(default) -> bool:
    """Whether the default config has sliding-window layers: a window size that is set and not switched off
    (`use_sliding_window`), or a layer pattern that names sliding layers."""
    pattern = getattr(default, "layer_types", None) or ()
    if any("sliding" in str(t) for t in pattern):
        return True
    if not getattr(default, "sliding_window", None):
        return False
    return bool(getattr(default, "use_sliding_window", True))


def _shrink(default, extra: dict | None = None):
    """`default` with its size fields made small, its sub-configs shrunk the same way and its layer
    pattern cut to the new depth; `extra` (per-family settings) is applied last."""
    params = set(inspect.signature(type(default).__init__).parameters)
    keys = set(vars(default)) | params
    overrides = {k: v for k, v in _SMALL.items() if k in keys}
    layers = overrides.get("num_hidden_layers", 4)
    for key, most in _AT_MOST.items():
        if isinstance(vars(default).get(key), int):
            overrides[key] = min(vars(default)[key], most)
    if "sliding_window" in keys and _uses_window(default):
        overrides["sliding_window"] = _WINDOW
    if isinstance(vars(default).get("rotary_dim"), int):  # a rotary part of each head (CodeGen, GPT-J): half
        overrides["rotary_dim"] = overrides.get("head_dim", 16) // 2
    if "kv_lora_rank" in keys:  # MLA: transformers' SDPA path expands no key/value groups there
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", 4)
        if vars(default).get("head_dim") == vars(default).get("qk_rope_head_dim") is not None:
            overrides["head_dim"] = overrides["qk_rope_head_dim"]  # head_dim names the rotary part (DeepSeek-V3)
    if vars(default).get("num_kv_shared_layers"):  # layers reusing an earlier layer's cache: half the depth
        overrides["num_kv_shared_layers"] = layers // 2
    for key in getattr(default, "sub_configs", None) or {}:
        sub = vars(default).get(key)
        if sub is not None and hasattr(sub, "to_dict"):
            try:
                overrides[key] = _shrink(sub)
            except Exception:  # noqa: BLE001  (a sub-config that cannot be shrunk alone is left as it is)
                pass
    overrides = {k: v for k, v in overrides.items() if not isinstance(getattr(type(default), k, None), property)}
    pattern = _layer_pattern(default, layers)
    extra = extra or {}
    # a field this config derives or validates otherwise: without the layer pattern, then the core sizes only
    core = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "pad_token_id")
    for attempt in ({**overrides, **pattern, **extra}, {**overrides, **extra}):
        try:
            return type(default)(**attempt)
        except Exception:  # noqa: BLE001
            pass
    return type(default)(**{k: v for k, v in overrides.items() if k in core}, **extra)


_FULL_MARKERS = ("full", "global")
_FULL_NAMES = ("attention", "hybrid")  # Granite / Jamba "attention"; Zamba "hybrid" (Mamba + shared attention)


def _is_full(kind) -> bool:
    return any(m in str(kind) for m in _FULL_MARKERS) or str(kind) in _FULL_NAMES


def _layer_pattern(default, layers: int) -> dict:
    """Per-layer settings cut to `layers`, with a full-attention layer at index 1 (so layers run
    after a drop) where the default pattern's first layers have none: every list of strings as long
    as the default depth (`layer_types`, `layers_block_type`, `mlp_layer_types`), periodic patterns
    (`attn_layer_period` / `attn_layer_offset`: Jamba, Zamba) and explicit indices
    (`attn_layer_indices`: Bamba). A hybrid whose default is attention-free (GraniteMoeHybrid)
    gets the first full-attention name its pattern uses, or "full_attention"; a pattern of sliding
    layers only (Ministral) is kept: the model has no full-attention layer to find."""
    depth = getattr(default, "num_hidden_layers", None)
    out = {}
    for key, value in vars(default).items():
        if isinstance(getattr(type(default), key, None), property):
            continue
        if isinstance(value, (list, tuple)) and value and len(value) == depth and all(isinstance(v, str) for v in value):
            cut = list(value)[:layers]
            all_sliding = all("sliding" in str(t) for t in value)  # Ministral: stays sliding-only, like Mistral
            if key in ("layer_types", "layers_block_type") and not any(_is_full(t) for t in cut) and not all_sliding:
                full = next((t for t in value if _is_full(t)), "full_attention")
                cut[min(1, layers - 1)] = full
            out[key] = cut
    if hasattr(default, "attn_layer_period"):
        out.update(attn_layer_period=2, attn_layer_offset=1)
    if hasattr(default, "attn_layer_indices"):
        out["attn_layer_indices"] = [1]
    return out


def _build(model_type: str):
    from transformers import AutoModelForCausalLM

    if _FAMILY.get(model_type, {}).get("skip"):
        return None, _FAMILY[model_type]["skip"]
    config = tiny_config(model_type)
    why = _not_decoder_only(model_type, config)
    if why:
        return None, why
    with torch.device("meta"):  # count first: a config left large must not fill the machine's memory
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(model_type)).parameters())
    if size > _MAX_PARAMETERS:
        raise ValueError(f"the shrinker left {size / 1e6:.0f}M parameters (its size fields have other names)")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as exc:  # no SDPA path in transformers for this model: its default attention
        if "scaled_dot_product_attention" not in str(exc):
            raise
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))  # a fresh config: the failed call set sdpa
    return model.eval(), ""


def census_one(model_type: str) -> CensusRow:
    import uniprefill
    from uniprefill import UniPrefillConfig

    start = time.perf_counter()
    row = CensusRow(model_type, "error")
    try:
        model, why = _build(model_type)
    except Exception as exc:  # noqa: BLE001
        row.status, row.reason = "skipped", f"no tiny config: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return row
    if model is None:
        row.status, row.reason = "skipped", why
        return row
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else 128
    ids = torch.randint(3, min(vocab, 128), (2, _LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = model(input_ids=ids[:1], use_cache=False).logits
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            row.causal = causal_probe(model, ids[:1], plain, 3, min(vocab, 128), _close)
    except Exception as exc:  # noqa: BLE001  (the shrinker's config, not the backend: the plain model fails)
        row.status = "skipped"
        row.reason = f"the tiny config does not run in the plain model: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        row.seconds = round(time.perf_counter() - start, 1)
        return row
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers="all", **SETTINGS))
            one = exact(input_ids=ids[:1], use_cache=False).logits[:, -1]
            why_first = exact.backend.last_unaccelerated  # later calls (generate) set their own
            ref_one = model(input_ids=ids[:1], use_cache=False).logits[:, -1]
            reports = uniprefill.graph_reports(exact)
            report = next((r for r in reports if r.rewritten), reports[-1] if reports else None)
            if report is not None:
                row.layer_kinds = " ".join(sorted({f"{r.kind}" for r in report.layers}))
            history = uniprefill.last_drop_report(exact)
            row.checks["prefill_batch1"] = _close(one, ref_one)
            two = exact(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
            ref_two = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
            row.checks["prefill_padded_batch"] = _close(two, ref_two)
            try:
                ref_gen = model.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
            except Exception as exc:  # noqa: BLE001  (the tiny config cannot generate in the plain model)
                ref_gen, row.generation = None, f"plain model cannot generate ({type(exc).__name__})"
            if ref_gen is not None:
                exact.backend.last_unaccelerated, generation_fell_back = None, False
                gen = exact.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
                row.generation = "equal" if torch.equal(gen, ref_gen) else "DIFFERS"
                generation_fell_back = bool(exact.backend.last_unaccelerated)
            accelerated = history is not None and bool(history.points)
            if accelerated and ref_gen is not None and generation_fell_back and row.generation == "equal":
                row.generation = "equal (generation unaccelerated)"  # the prefill dropped; generate() fell back
            if not accelerated:
                row.status = "unaccelerated"
                row.reason = (why_first or exact.backend.last_unaccelerated or (report.reason if report else "")
                              or "the prefill dropped nothing and no reason was recorded")
            else:
                torch._dynamo.reset()
                fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.5, drop_layers="all", **SETTINGS))
                out = fast(input_ids=ids[:1], use_cache=False).logits[:, -1]
                dropped = uniprefill.last_drop_report(fast)
                row.dropped = f"{dropped.overall_retention:.2f}" if dropped is not None and dropped.points else "none"
                row.checks["forced_drop_finite"] = bool(torch.isfinite(out).all())
                row.status = "accelerated"
                if row.dropped == "none":
                    row.reason = fast.backend.last_unaccelerated or "p < 1 dropped nothing"
                    if kind_of(row.reason) is Kind.REWRITE_FAILED:
                        row.status = "error"
            if not all(v is True for v in row.checks.values()) or row.generation == "DIFFERS":
                row.status = "mismatch"
                if not row.reason and row.checks.get("prefill_batch1") is False \
                        and all(v is True for k, v in row.checks.items() if k != "prefill_batch1"):
                    row.reason = _compiled_plain_differs(model, ids[:1], one, ref_one)
    except Exception as exc:  # noqa: BLE001
        row.status = "error"
        row.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if str(exc) else type(exc).__name__
        row.checks["traceback"] = traceback.format_exc(limit=3)[-600:]
    finally:
        torch._dynamo.reset()
        row.full_attention, row.full_attention_basis = full_attention(model_type, model.config, row.layer_kinds)
        row.seconds = round(time.perf_counter() - start, 1)
    return row


def _compiled_plain_differs(model, ids, one, ref_one) -> str:
    """Where uniprefill at p = 1 differs from the eager model, whether plain `torch.compile(backend="eager")` does
    too, and uniprefill equals it: then the model's traced graph is not its eager forward (transformers 5.17's Doge:
    its eager forward drops the causal mask that `sdpa_mask` skips, its traced graph keeps it)."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager", dynamic=True)(input_ids=ids, use_cache=False).logits[:, -1]
    except Exception:  # noqa: BLE001  (plain torch.compile fails too: no diagnosis, the row keeps its mismatch)
        return ""
    finally:
        torch._dynamo.reset()
    if _close(compiled, ref_one) or not _close(one, compiled):
        return ""
    gap = float((compiled.float() - ref_one.float()).abs().max())
    return (f"torch.compile itself changes this model's answer (backend='eager' vs the eager model: {gap:.3g}); "
            "uniprefill at p = 1 equals the compiled model")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() <= 1e-4 * max(1.0, float(b.float().abs().max())))


def table(rows: list[CensusRow], versions: str) -> str:
    counts = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [f"# Architecture census ({versions})", "",
             "Every causal-LM model type of the installed transformers, tiny random weights, 300-token prompts "
             "(`uniprefill census`; what each check means: `uniprefill/testing/census.py`).", "",
             "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" (of {len(rows)})", "",
             share_line(rows), "",
             "Eager attention (transformers runs these models without SDPA) is recognised in the graph as one "
             "attention site (`uniprefill/passes/sink_attention.py`): with learned per-head sinks (GPT-OSS, Flint, "
             "MiMo-V2-Flash's sliding layers; Granite-SWA's sinks applied after the attention), with soft-capped "
             "logits (Gemma-2, VaultGemma) or with a float32 softmax on half-precision logits, it runs as the "
             "`*_sink_attention` ops of `uniprefill/sink_ops.py`, in the prefill and in decode steps after a drop; "
             "plain eager attention (a max subtracted or not, also in the batched-matmul form of XGLM, TrOCR and "
             "GPT-NeoX-Japanese: `passes/eager_attention_forms.py`) becomes an SDPA call; ALiBi (Bloom's "
             "`baddbmm` bias, MPT's table sliced in each layer) is a per-key bias the sink ops read at the kept "
             "keys' original positions; a causal mask sliced from a table the model registers as a buffer (GPT-Neo, "
             "OpenAI-GPT: `passes/causal_table.py`) is read as causal, or as a sliding window (GPT-Neo's local "
             "layers), only while the table is exactly that band, checked on every call. Other eager forms are not "
             "matched, and the reason names the form. Several "
             "attention calls in one layer that share the queries, mask and scale (DiffLlama's differential "
             "attention) make one drop point scored with the first call.", "",
             "| model type | result | layer kinds | full attention | causal | generation (p = 1) "
             "| retention at keep 0.5 | reason | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = r.reason.replace("|", "/").replace("\n", " ")[:220]
        lines.append(f"| {r.model_type} | {r.status} | {r.layer_kinds} | {_full_cell(r)} | {causal_cell(r.causal, r.status)} "
                     f"| {r.generation} | {r.dropped} | {reason} | {r.seconds} |")
    return "\n".join(lines) + "\n"


def _full_cell(row: CensusRow) -> str:
    if row.full_attention is None:
        return "" if row.status == "skipped" else "?"
    basis = row.full_attention_basis.replace("|", "/")
    if row.full_attention:
        return "yes (graph)" if basis == "graph" else "yes (config)"
    return f"no: {basis}"


def as_dict(row: CensusRow) -> dict:
    return asdict(row)
