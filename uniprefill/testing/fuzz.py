"""A differential fuzzer: random calls through `uniprefill.compile` against the plain model.

Compilers are tested with random programs checked against a reference; this does the same
for the doors a user comes through. Every case draws an architecture (tiny random configs,
hybrids included), a call sequence and the arguments of each call (batch 1-3, padding
none / left / holes / right / an all-pad row, mask bool / int / float passed by keyword, position or
not at all, position ids none / offset / strided / packed documents, `input_ids` or
`inputs_embeds`, `use_cache`, `logits_to_keep`, dtype), or a generation mode (greedy,
seeded sampling, beam search, `num_return_sequences`, an explicit cache object, chunked prefill, an inferred
mask, stop tokens, logits processors, an assistant model), or a
prefill into a cache object passed in followed by one-token steps through the same forward,
or the same random forward calls (and `generate`) through plain `torch.compile(model,
backend="uniprefill")` (`fuzz_plain_compile`), and checks:

* at p = 1 the compiled model equals the plain model: logits at every real token within the
  dtype's tolerance, generated tokens exactly. Where greedy or beam tokens first differ and the
  plain model scores the two tokens within that tolerance (the processed scores, under logits
  processors), rounding flipped a tie (row-by-row
  prefill of a padded batch computes the same logits in another order; seen in bf16): the case
  counts as "tie", apart from "equal", with the gap in its detail. Likewise for the logits of a bf16
  batch the compiled model prefilled row by row, where they equal the plain model's own rows run one
  at a time and the plain model's batched logits part from those by more than the tolerance too;
* at p < 1 (Llama, Gemma-3, GPT-OSS, Qwen3-Next and Qwen3.5 with Gated DeltaNet layers after the drops; one row,
  or a left-padded batch through `generate`, row by row) the last logits equal the eager reference
  (`uniprefill.testing.eager_reference`) on the positions the drop history reports;
* at p < 1 a call that needs every position (labels, gradients, hidden states, router logits; any architecture)
  drops nothing, says why and equals the plain model, the gradient of the embeddings included
  (`fuzz_every_position`);
* a call long enough to drop that ran unaccelerated says why (`backend.last_unaccelerated`);
* a case leaves the process as it found it: one after which a process-wide torch setting that moves eager
  numerics (`torch_state`: threads, matmul precision, autocast, grad mode, ...) differs is an "error" naming it.
  After a `generate` token mismatch the plain model runs once more from the same seed, and the detail says whether
  it repeated its own answer. The summary records the `environment` (versions, CPU and its vector ISA) a replay
  must match.

Compiled models are pooled per (architecture, dtype, settings) and reused, so the ORDER of
calls varies across cases (a batch after a batch-1 call, lengths changing, two models
alternating); every `fresh_every` cases the pool is emptied and dynamo reset, so first calls
are exercised too. `run_fuzz` returns a `FuzzSummary`; `uniprefill fuzz` is the command.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from .fuzz_cases import (  # noqa: F401  (re-exported: tests and the CLI use them from here)
    _DELTANET_AFTER_DROP, _EXTRA_ARCHS, ARCHS, MIN_TOKENS, REFERENCE_ARCHS, SETTINGS, TOLERANCE, CaseResult,
    _decode_case, _forward_case, _compare_logits, _generate_case, _rows_alone_tie, _tie_at_divergence,
)
from .fuzz_every_position import _every_position_case
from .fuzz_reference import _reference_case  # noqa: F401
from .fuzz_plain_compile import RECOMPILE_LIMIT, _plain_compile_case  # noqa: F401

@dataclass
class FuzzSummary:
    cases: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    accelerated_calls: int = 0
    failures: list[CaseResult] = field(default_factory=list)
    ties: list[CaseResult] = field(default_factory=list)
    invalid: list[CaseResult] = field(default_factory=list)  # the plain model refused the input (detail: its error)
    seconds: float = 0.0
    environment: dict = field(default_factory=dict)  # `environment()` when the run began

    @property
    def mismatches(self) -> int:
        return sum(self.by_status[s] for s in ("mismatch", "error", "unexplained"))

    def add(self, result: CaseResult) -> None:
        self.cases += 1
        self.by_status[result.status] += 1
        self.by_kind[result.kind] += 1
        self.accelerated_calls += result.accelerated
        for reason in result.reasons:
            self.reasons[_reason_class(reason)] += 1
        if result.status in ("mismatch", "error", "unexplained"):
            self.failures.append(result)
        elif result.status == "tie":
            self.ties.append(result)
        elif result.status == "invalid":
            self.invalid.append(result)

    def __str__(self) -> str:
        lines = [f"{self.cases} cases in {self.seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_status.items())),
                 "kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items())),
                 f"calls that ran the rewritten graph: {self.accelerated_calls}",
                 "calls run unaccelerated, by reason:"]
        lines += [f"  {n:5d}  {r}" for r, n in self.reasons.most_common()]
        lines += [f"FAILED case {f.case} ({f.arch}, {f.kind}): {f.status}: {f.detail}" for f in self.failures[:20]]
        lines += [f"TIE case {t.case} ({t.arch}, {t.kind}): {t.detail}" for t in self.ties[:20]]
        return "\n".join(lines)


    def as_json(self, seed: int, archs) -> dict:
        return {"cases": self.cases, "seed": seed, "archs": list(archs), "seconds": self.seconds,
                "by_status": dict(self.by_status), "by_kind": dict(self.by_kind),
                "accelerated_calls": self.accelerated_calls, "unaccelerated_reasons": dict(self.reasons),
                "failures": [vars(f) for f in self.failures], "ties": [vars(t) for t in self.ties],
                "invalid": [vars(i) for i in self.invalid], "environment": self.environment}


def environment() -> dict:
    """What a replay must match: versions, the CPU and its vector ISA, threads, and the process-wide torch state
    that changes eager numerics (`torch_state`)."""
    import platform

    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), **torch_state()}


def torch_state() -> dict:
    """The process-wide torch settings an earlier case could leave changed and that change eager numerics: a
    case's result differs only if one moved. `run_fuzz` makes the case after which one moved an "error" naming it
    (a case must leave the process as it found it), and compares later cases with the new state."""
    return {"threads": torch.get_num_threads(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "autocast_cpu": torch.is_autocast_enabled("cpu"), "grad": torch.is_grad_enabled(),
            "inference_mode": torch.is_inference_mode_enabled(), "default_dtype": str(torch.get_default_dtype()),
            "deterministic": torch.are_deterministic_algorithms_enabled(), "mkldnn": torch.backends.mkldnn.enabled,
            "sdpa_backends": [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                              torch.backends.cuda.math_sdp_enabled()]}


def _reason_class(reason: str) -> str:
    """The reason without its numbers (row indices, lengths), so that counts group."""
    import re

    return re.sub(r"\d+", "N", reason)[:160]


def build_model(arch: str, dtype: torch.dtype):
    """A tiny random-weight model of `arch` (seeded), in eval mode: SDPA attention, except GPT-OSS
    (eager attention with learned sinks, the only form transformers runs it in), Gemma-2 (eager with
    soft-capped logits, likewise) and "llama-eager". "qwen3-next-6" (MoE) and "qwen3.5-6" (dense) put full
    attention at layers 1 and 4 of 6, so that Gated DeltaNet layers run on the kept tokens after both drop points
    (the tiny presets put their full layer last)."""
    import transformers

    from ..models.presets import build_random_model

    torch.manual_seed(0)
    if arch == "gpt-oss":  # eager attention with learned sinks (transformers' default for it)
        cfg = transformers.GptOssConfig(
            vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=48,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=4096, pad_token_id=0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        with torch.no_grad():
            for layer in model.model.layers:  # sinks that matter (the init leaves them near 0)
                layer.self_attn.sinks.normal_(0, 2.0)
    elif arch == "llama-eager":  # plain eager attention (attn_implementation="eager")
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    elif arch == "gemma2":  # eager attention with soft-capped logits (transformers runs Gemma-2 eager only)
        cfg = transformers.Gemma2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=48, attn_logit_softcapping=1.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=4096, pad_token_id=0)  # a cap of 1.0 binds on these logits (50 would not)
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    elif arch in _DELTANET_AFTER_DROP:  # full attention at 1 and 4: each drop point has Gated DeltaNet layers after it
        from ..models.presets import _TINY, _TINY_DELTANET

        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        cfg = getattr(transformers, _DELTANET_AFTER_DROP[arch])(
            num_hidden_layers=6, layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention", "full_attention", "linear_attention"],
            **(moe if arch == "qwen3-next-6" else {}), **_TINY_DELTANET, **_TINY)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    elif arch in _EXTRA_ARCHS:
        cfg = getattr(transformers, _EXTRA_ARCHS[arch])(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
            **({"sliding_window": None} if arch == "mistral" else {}))
        cfg._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        model = build_random_model(arch, dtype, "cpu")
    return model.eval()


class _Pool:
    def __init__(self) -> None:
        self.entries: dict = {}

    def get(self, arch: str, dtype: torch.dtype, **options):
        import uniprefill

        key = (arch, dtype, tuple(sorted(options.items())))
        if key not in self.entries:
            model = self.entries.get((arch, dtype, "model")) or build_model(arch, dtype)
            self.entries[(arch, dtype, "model")] = model
            config = uniprefill.UniPrefillConfig(drop_layers=_first_full_layers(model), **SETTINGS, **options)
            self.entries[key] = (model, uniprefill.compile(model, config))
        return self.entries[key]

    def get_plain(self, arch: str, dtype: torch.dtype, door: str, flags: tuple = ()):
        """(plain model, a copy compiled by plain torch.compile): `door` "module" is `torch.compile(copy,
        backend="uniprefill", options=...)`, "module twin" the same of another copy (a second model of the class),
        "in place" is `copy.compile(backend="uniprefill", options=...)`, "method" is transformers' idiom
        `copy.forward = torch.compile(copy.forward, backend="uniprefill", options=...)`. `flags`: torch.compile's
        own keywords a user adds, as (name, value) pairs (`dynamic`, `fullgraph`)."""
        import copy

        key = (arch, dtype, "plain", door, flags)
        if key not in self.entries:
            model = self.entries.get((arch, dtype, "model")) or build_model(arch, dtype)
            self.entries[(arch, dtype, "model")] = model
            twin = copy.deepcopy(model)
            options = {"p": 1.0, "drop_layers": _first_full_layers(model), **SETTINGS}
            flags = dict(flags)
            if door in ("module", "module twin"):
                compiled = torch.compile(twin, backend="uniprefill", options=options, **flags)
            elif door == "method":
                twin.forward = torch.compile(twin.forward, backend="uniprefill", options=options, **flags)
                compiled = twin
            else:
                twin.compile(backend="uniprefill", options=options, **flags)
                compiled = twin
            self.entries[key] = (model, compiled)
        return self.entries[key]

    def clear(self) -> None:
        self.entries.clear()
        torch._dynamo.reset()


def _first_full_layers(model):
    """The drop points every pooled model uses: its first two full-attention layers ("all" where none)."""
    from uniprefill.models.layer_kinds import LayerKind, layer_kinds

    return tuple(i for i, k in enumerate(layer_kinds(model.config)) if k == LayerKind.FULL)[:2] or "all"


def run_case(rng: random.Random, pool: _Pool, case: int, archs=ARCHS) -> CaseResult:
    arch = rng.choice(archs)
    dtype = torch.bfloat16 if rng.random() < 0.1 else torch.float32
    roll = rng.random()
    try:
        if roll < 0.1 and arch in REFERENCE_ARCHS:
            return _reference_case(rng, pool, case, arch, dtype)
        if roll < 0.25:
            return _generate_case(rng, pool, case, arch, dtype)
        if roll < 0.35:
            return _decode_case(rng, pool, case, arch, dtype)
        if roll < 0.45:
            return _plain_compile_case(rng, pool, case, arch, dtype)
        if roll < 0.5:
            return _every_position_case(rng, pool, case, arch, dtype)
        return _forward_case(rng, pool, case, arch, dtype)
    except Exception as exc:  # noqa: BLE001  (an exception of the compiled path is a finding)
        return CaseResult(case, arch, "?", "error", f"{type(exc).__name__}: {exc}"[:500])


def run_fuzz(cases: int, seed: int = 0, archs=ARCHS, fresh_every: int = 25, progress=None,
             seconds: float | None = None) -> FuzzSummary:
    """Run `cases` random cases from `seed` (fewer if `seconds` pass first: at least one, and the
    case running then is finished); `progress(i, summary)` is called after each."""
    rng = random.Random(seed)
    pool = _Pool()
    summary = FuzzSummary(environment=environment())
    state = torch_state()
    start = time.perf_counter()
    with warnings.catch_warnings(), contextlib.ExitStack():
        warnings.simplefilter("ignore")
        for i in range(cases):
            if seconds is not None and i > 0 and time.perf_counter() - start > seconds:
                break
            if i % fresh_every == 0:
                pool.clear()
            result = run_case(rng, pool, seed * 1_000_003 + i, archs)
            now = torch_state()
            moved = {k: (state[k], v) for k, v in now.items() if v != state[k]}
            if moved:  # a finding whoever left it (the plain model's code or ours): named on the case that did
                result.detail += f"; process-wide torch state changed by this case (before, after): {moved}"
                result.status = "error" if result.status in ("equal", "tie", "invalid") else result.status
                state = now
            summary.add(result)
            summary.seconds = time.perf_counter() - start
            if progress is not None:
                progress(i + 1, summary)
    return summary
