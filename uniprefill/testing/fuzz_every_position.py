"""The fuzzer's calls that need every position, below p = 1: unaccelerated, with the reason, equal to the plain model.

At forced retention a dropped prefill answers for the last position only (README, "Output contract"). A call that
asks for more -- a loss over `labels`, gradients, every layer's hidden states, MoE router logits -- must run the
plain model and say why. `_every_position_case` draws one such request on a pooled model of any architecture at
keep ratio 0.3 / 0.5 / 0.8, a prompt long enough to drop (one row, or a left-padded batch of two), `use_cache` off
or left to the config, and checks:

* where the plain model answers `output_router_logits` with no router logits (transformers 5.17's GraniteMoeHybrid),
  the call asks for nothing per position: counted invalid, not checked (round 52 found the backend rightly dropping);
* nothing dropped (no drop history after the call) and the backend gave a reason (`last_unaccelerated`; a rewrite
  that raised is an error, as everywhere in the fuzzer);
* the outputs equal the plain model's within the dtype's tolerance: the logits at every real position, the loss, the
  hidden states or router logits asked for, and under gradients the gradient of the summed real-position logits
  with respect to the embedding matrix (so backward through the compiled call is checked too);
* except for a tie: a bf16 batch that the compiled model prefilled row by row, whose logits equal the plain model's
  rows run one at a time while the plain model's own batched logits part from those (`_rows_alone_tie`; round 61's
  case 1093004279057, tiny Qwen3-Next in bf16 under gradients: the padded row's chunked scan rounds otherwise).
"""

from __future__ import annotations

import torch

from .fuzz_cases import (MIN_TOKENS, CaseResult, _accelerated, _compare_extras, _compare_logits, _compare_tensor,
                         _rows_alone_tie)
from .fuzz_reference import _explained, _left_padded

REQUESTS = ("labels", "labels with pads ignored", "gradients", "output_hidden_states", "output_router_logits")


def _every_position_case(rng, pool, case, arch, dtype, request: str | None = None) -> CaseResult:
    ratio = rng.choice([0.3, 0.5, 0.8])
    model, fast = pool.get(arch, dtype, keep_ratio=ratio)
    requests = [r for r in REQUESTS if r != "output_router_logits" or hasattr(model.config, "output_router_logits")]
    if request is not None and request not in requests:
        raise ValueError(f"{request!r} is not a request {arch} answers (the choices: {requests})")
    request = request or rng.choice(requests)
    lengths = [rng.randint(MIN_TOKENS + 16, 200) for _ in range(rng.choice([1, 1, 2]))]
    gen = torch.Generator().manual_seed(case)
    ids, mask = _left_padded([torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lengths])
    kwargs: dict = {"input_ids": ids}
    if len(lengths) > 1:
        kwargs["attention_mask"] = mask
    use_cache = rng.choice([False, None])
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    if request.startswith("labels"):
        kwargs["labels"] = ids if request == "labels" else ids.masked_fill(mask == 0, -100)
    elif request.startswith("output_"):
        kwargs[request] = True
    result = CaseResult(case, arch, "every position p<1", "equal",
                        detail=f"{request}, rows of {lengths} tokens, keep_ratio {ratio}, use_cache {use_cache}, "
                               f"{str(dtype).removeprefix('torch.')}")
    weight = model.get_input_embeddings().weight
    fast.backend.last_unaccelerated = None
    with torch.set_grad_enabled(request == "gradients"):
        out = fast(**kwargs)
        dropped, reason = _accelerated(fast), fast.backend.last_unaccelerated
        got_grad = _embedding_grad(out.logits, mask, weight) if request == "gradients" else None
        ref = model(**kwargs)
        want_grad = _embedding_grad(ref.logits, mask, weight) if request == "gradients" else None
    if request == "output_router_logits" and ignores_router_logits(ref):
        result.status = "invalid"  # nothing per position is asked of the model: a plain forward (the output contract)
        result.detail = f"the plain model returns no router logits for output_router_logits; {result.detail}"
        return result
    if dropped:
        result.status, result.detail = "mismatch", f"dropped although the call needs every position; {result.detail}"
        return result
    if not _explained(result, reason):
        return result
    bad = _compare_logits(out.logits, ref.logits, mask, None, dtype) or _compare_extras(out, ref, kwargs, dtype) \
        or _compare_tensor("loss", getattr(out, "loss", None), getattr(ref, "loss", None), dtype) \
        or _compare_tensor("embedding gradient", got_grad, want_grad, dtype)
    tie = _rows_alone_tie(model, fast, out.logits, ref.logits, mask, kwargs, dtype) \
        if bad and bad.startswith("logits") else None
    if tie is not None:  # only the logits compared then: a batch's other outputs round as its logits do
        result.status, result.detail = "tie", f"unaccelerated, the logits {tie}; {result.detail}"
    elif bad:
        result.status, result.detail = "mismatch", f"unaccelerated, vs the plain model: {bad}; {result.detail}"
    return result


def ignores_router_logits(output) -> bool:
    """Whether a model's output carries no router logits although the call asked for them (transformers 5.17's
    GraniteMoeHybrid: no `router_logits`, `aux_loss` 0): then the call needs no position but the last, and the
    backend may drop (it saw no per-token output in the graph)."""
    logits = getattr(output, "router_logits", None)
    return logits is None or (isinstance(logits, (tuple, list)) and len(logits) == 0)  # a tensor has no truth value


def _embedding_grad(logits: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(logits.float()[mask.bool()].sum(), weight)[0]

