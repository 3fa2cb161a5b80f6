"""The fuzzer's cases below p = 1: forced retention checked against the eager reference.

`_reference_case` draws a keep ratio for a pooled Llama, Gemma-3, GPT-OSS or Gated DeltaNet hybrid and checks, a
third of the time each: a single-row prompt's prefill (its last logits; under `no_grad`, `inference_mode` or bf16
autocast, `fuzz_cases._grad_free`, the reference under the same); decode steps after such a drop (tokens fed
one per forward on the cache the prefill filled, a next turn of several tokens in one forward, or greedy `generate`
with its logits returned); a left-padded batch of rows of different lengths through `generate`
(`_batch_after_drop`: each row drops on its own, and is checked against the reference alone).
Each step's logits must equal `eager_reference.reference_last_logits` over the prompt and the tokens
so far, with every drop layer's kept set extended by the new tokens: a layer after a drop attends over the kept
prompt tokens at their original positions and every token decoded since, which is what decoding on compacted
caches means (`runtime.generation`). A call that dropped nothing must say why and equal the plain model.
"""

from __future__ import annotations

import torch

from ..unaccelerated import Kind, kind_of
from .fuzz_cases import MIN_TOKENS, CaseResult, _compare_logits, _grad_free

DECODE_MODES = ("one token per forward", "next turn in one forward", "generate")


def _reference_case(rng, pool, case, arch, dtype) -> CaseResult:
    ratio = rng.choice([0.3, 0.5, 0.8])
    model, fast = pool.get(arch, torch.float32, keep_ratio=ratio)
    length = rng.randint(MIN_TOKENS + 16, 260)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(case))
    roll = rng.random()
    if roll < 1 / 3:
        return _batch_after_drop(rng, model, fast, case, arch, ratio)
    if roll < 2 / 3:
        return _decode_after_drop(rng, model, fast, case, arch, ids, ratio)
    return _prefill_after_drop(rng, model, fast, case, arch, ids, ratio)


def _prefill_after_drop(rng, model, fast, case, arch, ids, ratio) -> CaseResult:
    """One single-row prefill at forced retention: its last logits against the eager reference over the kept
    positions, both under the drawn context (`_grad_free`: `no_grad`, `inference_mode` or bf16 autocast)."""
    length = ids.shape[1]
    use_cache = rng.choice([True, False])
    context, grad_free, tolerance_dtype = _grad_free(rng, torch.float32)
    result = CaseResult(case, arch, "reference p<1", "equal",
                        detail=f"length {length}, keep_ratio {ratio}, under {context}")
    with grad_free():
        out = fast(input_ids=ids, use_cache=use_cache).logits[:, -1]
        history = fast.history
        if history is None or not history.points:
            return _unaccelerated(result, fast, out, lambda: model(input_ids=ids, use_cache=use_cache).logits[:, -1],
                                  tolerance_dtype)
        kept = {p.layer: p.kept_positions(0, length) for p in history.points}
        ref = _reference(model, ids, kept, 0)
    result.accelerated = 1
    bad = _compare_logits(out[:, None], ref[:, None], torch.ones(1, 1), None, tolerance_dtype)
    if bad:
        result.status, result.detail = "mismatch", f"vs the eager reference: {bad}; {result.detail}"
    return result


def _decode_after_drop(rng, model, fast, case, arch, ids, ratio, mode: str | None = None) -> CaseResult:
    from transformers import DynamicCache

    length, steps, mode = ids.shape[1], rng.randint(1, 6), mode or rng.choice(DECODE_MODES)
    result = CaseResult(case, arch, "reference decode p<1", "equal",
                        detail=f"length {length}, keep_ratio {ratio}, {steps} step(s), {mode}")
    new = torch.randint(3, model.config.vocab_size, (1, steps), generator=torch.Generator().manual_seed(case + 1))
    with torch.no_grad():
        if mode == "generate":  # logits of the prefill's last token, then of each greedy token but the last
            out = fast.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[:, length:length + steps - 1]
            logits = torch.stack(out.logits, dim=1).float()
        else:  # logits of the prefill's last token, then of each of `new` (teacher-forced tokens)
            cache = DynamicCache(config=model.config)
            first = fast(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:]
            if mode == "next turn in one forward":
                after = fast(input_ids=new, past_key_values=cache, use_cache=True).logits
            else:
                after = torch.cat([fast(input_ids=new[:, i:i + 1], past_key_values=cache, use_cache=True).logits
                                   for i in range(steps)], dim=1)
            logits = torch.cat([first, after], dim=1).float()
        history = fast.history
        if history is None or not history.points:
            if mode == "generate":
                return _unaccelerated(result, fast, out.sequences, lambda: model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                    pad_token_id=0))
            full = torch.cat([ids, new], dim=1)
            return _unaccelerated(result, fast, logits, lambda: model(input_ids=full).logits[:, length - 1:].float())
        kept = {p.layer: p.kept_positions(0, length) for p in history.points}
        seq = torch.cat([ids, new], dim=1)
        ref = torch.stack([_reference(model, seq[:, :length + i], kept, i) for i in range(logits.shape[1])], dim=1)
    result.accelerated = 1
    bad = _compare_logits(logits, ref, torch.ones(1, logits.shape[1]), None, torch.float32)
    if bad:
        result.status, result.detail = "mismatch", f"vs the eager reference: {bad}; {result.detail}"
    return result


def _batch_after_drop(rng, model, fast, case, arch, ratio, rows: int | None = None) -> CaseResult:
    """A left-padded batch of 2-3 prompts of different lengths through greedy `generate` at forced retention (its
    logits returned): each row is prefilled alone and drops on its own (`fast.row_histories`: positions in the row
    without its pads), so each row's logits, the prefill's last and each step's after it, must equal the eager
    reference over that row alone with its own kept positions (a row that dropped nothing: over every position)."""
    rows = rows or rng.choice([2, 3])
    steps = rng.randint(1, 4)
    lengths = [rng.randint(MIN_TOKENS + 16, 260) for _ in range(rows)]
    gen = torch.Generator().manual_seed(case)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    ids, mask = _left_padded(prompts)
    width = ids.shape[1]
    result = CaseResult(case, arch, "reference batch p<1", "equal",
                        detail=f"left-padded rows of {lengths} tokens, keep_ratio {ratio}, {steps} step(s)")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = fast.generate(**kwargs, output_logits=True, return_dict_in_generate=True)
        histories = fast.row_histories
        if not histories or not any(h is not None and h.points for h in histories):
            return _unaccelerated(result, fast, out.sequences, lambda: model.generate(**kwargs))
        logits = torch.stack(out.logits, dim=1).float()
        steps = logits.shape[1]  # fewer where every row met an end token
        for r, (prompt, history) in enumerate(zip(prompts, histories)):
            kept = {} if history is None else {p.layer: p.kept_positions(0, history.seq_len) for p in history.points}
            if any(int(pos.max()) >= prompt.numel() for pos in kept.values() if pos.numel()):
                result.status = "mismatch"
                result.detail = f"row {r}'s history keeps positions past its {prompt.numel()} tokens; {result.detail}"
                return result
            seq = torch.cat([prompt, out.sequences[r, width:width + steps - 1]])[None]
            ref = torch.stack([_reference(model, seq[:, :prompt.numel() + i], kept, i) for i in range(steps)], dim=1)
            bad = _compare_logits(logits[r:r + 1], ref, torch.ones(1, steps), None, torch.float32)
            if bad:
                result.status, result.detail = "mismatch", f"row {r} vs the eager reference: {bad}; {result.detail}"
                return result
    result.accelerated = 1
    return result


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch (pad id 0) and its attention mask."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, prompt in enumerate(prompts):
        ids[r, width - prompt.numel():], mask[r, width - prompt.numel():] = prompt, 1
    return ids, mask


def _reference(model, seq, kept: dict, decoded: int) -> torch.Tensor:
    """The eager reference's last logits of `seq` ([1, prompt + decoded]): each drop layer keeps its kept prompt
    positions and the `decoded` tokens after the prompt."""
    from .eager_reference import reference_last_logits

    prompt = seq.shape[1] - decoded
    extended = {layer: torch.cat([pos, torch.arange(prompt, seq.shape[1])]) for layer, pos in kept.items()}
    return reference_last_logits(model, seq, extended).float()


def _unaccelerated(result: CaseResult, fast, out, plain, tolerance_dtype=torch.float32) -> CaseResult:
    """A case whose prefill dropped nothing: it must say why (a rewrite that raised is an error), and `out` must be
    the plain model's answer (`plain()`: logits within `tolerance_dtype`'s tolerance, or tokens exactly)."""
    if not _explained(result, fast.backend.last_unaccelerated):
        return result
    ref = plain()
    if ref.dtype == torch.long:
        bad = None if torch.equal(out, ref) else f"tokens {out.tolist()} vs {ref.tolist()}"
    else:
        out = out if out.dim() == 3 else out[:, None]
        ref = ref if ref.dim() == 3 else ref[:, None]
        bad = _compare_logits(out, ref, torch.ones(out.shape[:2]), None, tolerance_dtype)
    if bad:
        result.status, result.detail = "mismatch", f"unaccelerated, vs the plain model: {bad}; {result.detail}"
    return result


def _explained(result: CaseResult, reason) -> bool:
    """Whether a call that dropped nothing gave a reason that is not a failure; else `result` becomes
    "unexplained" (no reason) or "error" (the rewritten graph raised: a finding, as in every kind). A reason that
    passes is recorded in `result.reasons`."""
    if reason is None:
        result.status, result.detail = "unexplained", f"nothing dropped; {result.detail}"
        return False
    if kind_of(reason) is Kind.REWRITE_FAILED:
        result.status, result.detail = "error", f"{reason}; {result.detail}"
        return False
    result.reasons.append(reason)
    return True
