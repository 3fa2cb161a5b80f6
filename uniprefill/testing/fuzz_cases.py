"""The case kinds of the differential fuzzer (`uniprefill.testing.fuzz`), and what they share.

Each `_*_case(rng, pool, case, arch, dtype)` draws its calls from `rng`, runs them through a
pooled compiled model and the plain model, and returns a `CaseResult`:

* `_forward_case`: one or more forward calls (arguments by keyword or position, padding,
  masks, position ids, caches, `logits_to_keep`, a second model alternating), each under `no_grad`,
  `inference_mode` or bf16 autocast (`_grad_free`);
* `_generate_case`: `generate` in one decoding mode (greedy, sampling, beam, beam sampling, several
  sequences, an explicit cache, a static cache, no cache (each step a whole forward), every step's
  logits returned and compared, prompt lookup, a chat's next turn on the returned cache, the prompt
  given as `inputs_embeds`, chunked prefill, the mask left for `generate` to infer from pad tokens,
  stop tokens that end rows early, logits processors reading the prompt, an assistant model); in the
  deterministic modes a first differing token that the plain model scores as a tie (after the same
  logits processors, where the mode has them) counts as "tie" (`_tie_at_divergence`). The plain
  model raising inside uniprefill's code is an "error" (`_plain_model_raised`: `compat`'s
  process-wide ops are in its path), elsewhere "invalid";
* `_decode_case`: a prefill into a cache passed in (or of two rows, prefilled row by row), then steps of one
  or several tokens through forward (as `input_ids`, or as `inputs_embeds`);
* `_reference_case` (`fuzz_reference`): forced retention against the eager reference (Llama, Gemma-3, GPT-OSS,
  Qwen3-Next, Qwen3.5), the prefill's last logits or decode steps after it;
* `_every_position_case` (`fuzz_every_position`): forced retention on a call that needs every position (labels,
  gradients, hidden states, router logits): it must drop nothing, say why and equal the plain model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
from dataclasses import dataclass, field

import torch

from ..runtime.continuation import recurrent_layers
from ..unaccelerated import Kind, kind_of

SETTINGS = dict(sink=16, last_q=16, block_size=16)
MIN_TOKENS = SETTINGS["sink"] + SETTINGS["last_q"]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # times max(1, |reference|max)
_EXTRA_ARCHS = {"mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "phi3": "Phi3Config"}
_DELTANET_AFTER_DROP = {"qwen3-next-6": "Qwen3NextConfig", "qwen3.5-6": "Qwen3_5TextConfig"}
ARCHS = ("tiny-llama", "tiny-gemma3", "tiny-qwen3-next", "tiny-qwen3.5", "tiny-lfm2", "tiny-granitemoehybrid",
         "tiny-jamba", "tiny-olmo3", *_EXTRA_ARCHS, "gpt-oss", "llama-eager", "gemma2", *_DELTANET_AFTER_DROP)
REFERENCE_ARCHS = ("tiny-llama", "tiny-gemma3", "gpt-oss", *_DELTANET_AFTER_DROP)


@dataclass
class CaseResult:
    case: int
    arch: str
    kind: str
    status: str  # "equal", "tie", "mismatch", "error", "unexplained", "invalid"
    detail: str = ""
    reasons: list[str] = field(default_factory=list)  # why calls ran unaccelerated
    accelerated: int = 0  # calls that ran the rewritten graph


def _plain_model_raised(result: CaseResult, exc: Exception) -> CaseResult:
    """The plain model refused the input: not a case ("invalid"), unless it raised inside uniprefill's own code (an
    op or drop-in a process-wide change of `compat` put in its path): that is an "error", a finding."""
    import importlib.util
    import os
    import traceback

    roots = [os.path.dirname(os.path.dirname(__file__)),  # the uniprefill package, and its kernels
             os.path.dirname(importlib.util.find_spec("uniprefill.kernels").origin)]
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if any(f.filename.startswith(r + os.sep) for r in roots)
            and os.sep + "testing" + os.sep not in f.filename]
    where = f" in {os.path.basename(ours[-1].filename)}:{ours[-1].lineno}" if ours else ""
    result.status = "error" if ours else "invalid"
    result.detail = f"plain model raised{where} {type(exc).__name__}: {exc}"[:300] + f"; {result.detail}"[:200]
    return result


def _random_inputs(rng: random.Random, model, dtype) -> dict:
    vocab = model.config.vocab_size
    rows = rng.choice([1, 1, 2, 3])
    length = rng.choice([rng.randint(8, MIN_TOKENS - 1), rng.randint(MIN_TOKENS, 120), rng.randint(120, 260)])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    spec = {"rows": rows, "length": length}
    spec["padding"] = padding = rng.choice(["none", "none", "left", "holes", "right"]
                                           + (["all-pad row"] if rows > 1 else []))
    mask = torch.ones(rows, length, dtype=torch.int64)
    if padding == "left":
        for r in range(rows):
            mask[r, : rng.randint(0, length // 2)] = 0
    elif padding == "holes":
        r = rng.randrange(rows)
        a = rng.randint(0, length - 2)
        mask[r, a: rng.randint(a + 1, length - 1)] = 0
    elif padding == "all-pad row":
        mask[rng.randrange(rows)] = 0
    elif padding == "right":  # the last rows' tails are pads: the last position of a row is then a pad
        for r in range(rng.randrange(rows), rows):
            mask[r, length - rng.randint(1, length - 1):] = 0
    # without padding, also a 4-D mask of the caller's own: the causal one, or packed documents (block-diagonal)
    form = rng.choice(["int", "bool", "float", "absent", "4d causal", "4d documents"] if padding == "none"
                      else ["int", "bool", "float"])
    spec["mask"] = form
    kwargs = {"input_ids": ids}
    if form.startswith("4d"):
        visible = torch.tril(torch.ones(length, length, dtype=torch.bool))
        if form == "4d documents":
            cut = rng.randint(1, length - 1)
            visible[cut:, :cut] = False
        kwargs["attention_mask"] = visible[None, None].expand(rows, 1, length, length)
    elif form != "absent":
        kwargs["attention_mask"] = {"int": mask, "bool": mask.bool(), "float": mask.to(dtype)}[form]
    spec["positions"] = positions = rng.choice(["none", "none", "offset", "strided", "packed"])
    if positions != "none":
        base = torch.arange(length)
        if positions == "offset":
            pos = base + rng.randint(1, 50)
        elif positions == "strided":
            pos = base * 2
        else:
            cut = rng.randint(1, length - 1)
            pos = torch.cat([torch.arange(cut), torch.arange(length - cut)])
        kwargs["position_ids"] = pos[None].expand(rows, -1) if rng.random() < 0.5 else pos[None]
    if rng.random() < 0.1:
        kwargs["inputs_embeds"] = model.get_input_embeddings()(kwargs.pop("input_ids")).detach()
        spec["embeds"] = True
    use_cache = rng.choice([None, True, False])
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    keep = rng.choice([None, None, 0, 1])
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    spec["positional"] = rng.random() < 0.3
    extras = ["output_hidden_states"] + (["output_router_logits"] if hasattr(model.config, "output_router_logits") else [])
    if rng.random() < 0.1:  # outputs beside the logits, which need every position: unaccelerated, equal
        spec["extra output"] = name = rng.choice(extras)
        kwargs[name] = True
    return {"kwargs": kwargs, "spec": spec, "mask": mask}


def _compare_extras(out, ref, kwargs: dict, dtype) -> str | None:
    """The hidden states and router logits a call asked for, against the plain model's: same count, shapes, values."""
    for name, attribute in (("output_hidden_states", "hidden_states"), ("output_router_logits", "router_logits")):
        if not kwargs.get(name):
            continue
        got, want = getattr(out, attribute, None), getattr(ref, attribute, None)
        if (got is None) != (want is None) or (want is not None and len(got) != len(want)):
            return f"{attribute}: {None if got is None else len(got)} tensors vs {None if want is None else len(want)}"
        for i, (a, b) in enumerate(zip(got or (), want or ())):
            bad = _compare_tensor(f"{attribute}[{i}]", a, b, dtype)
            if bad:
                return bad
    return None


def _compare_tensor(name: str, got, want, dtype) -> str | None:
    """One output tensor (or None) against the plain model's: both or neither, same shape, values within the
    dtype's tolerance times max(1, |want|max)."""
    if (got is None) != (want is None):
        return f"{name}: {'none' if got is None else 'one'} from the compiled call, " \
               f"{'none' if want is None else 'one'} from the plain model"
    if want is None:
        return None
    if got.shape != want.shape:
        return f"{name} differs in shape: {tuple(got.shape)} vs {tuple(want.shape)}"
    tol = TOLERANCE[dtype] * max(1.0, float(want.float().abs().max())) if want.numel() else 0.0
    worst = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    return f"{name} differs by {worst:.3g} (tolerance {tol:.3g})" if worst > tol else None


def _call(target, model, kwargs: dict, positional: bool):
    if positional and "input_ids" in kwargs:
        names = list(inspect.signature(type(model).forward).parameters)[1:4]
        args, rest = [], dict(kwargs)
        for name in names:
            if name not in rest:
                break
            args.append(rest.pop(name))
        return target(*args, **rest)
    return target(**kwargs)


def _compare_logits(out, ref, mask: torch.Tensor, keep, dtype) -> str | None:
    if out.shape != ref.shape:
        return f"logits shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    real = mask.bool()
    if out.shape[1] != real.shape[1]:
        real = real[:, -out.shape[1]:]
    real = real.clone()
    real[:, -1] = True  # the last position is the method's answer, a pad there too (right padding)
    tol = TOLERANCE[dtype] * max(1.0, float(ref.float().abs().max()))
    diff = (out.float() - ref.float()).abs().amax(-1)  # [rows, positions]
    worst = float(diff[real].max()) if real.any() else 0.0
    if worst > tol:
        return f"logits differ by {worst:.3g} at real tokens (tolerance {tol:.3g})"
    return None


def _accelerated(fast) -> bool:
    history = fast.history
    rows = fast.row_histories
    return bool((history is not None and history.points) or (rows and any(h is not None and h.points for h in rows)))


def _grad_free(rng, dtype) -> tuple[str, object, torch.dtype]:
    """How an inference call is made: under `torch.no_grad()` (most), `torch.inference_mode()`, or, for an fp32
    model, `no_grad` with CPU autocast to bf16 (the matmuls in bf16: bf16's tolerance applies). Returns (name, a
    context factory, the dtype whose tolerance applies); both models run under the same context."""
    roll = rng.random()
    if roll < 0.1:
        return "inference_mode", torch.inference_mode, dtype
    if roll < 0.2 and dtype is torch.float32:
        return "autocast bf16", _autocast_bf16_no_grad, torch.bfloat16
    return "no_grad", torch.no_grad, dtype


@contextlib.contextmanager
def _autocast_bf16_no_grad():
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def _forward_case(rng, pool, case, arch, dtype) -> CaseResult:
    result = CaseResult(case, arch, "forward", "equal")
    archs = [arch] + ([rng.choice(ARCHS)] if rng.random() < 0.2 else [])
    # a quarter of the cases also turn on block-sparse attention before the first drop point, at
    # full density (every block kept: still equal; below 256 tokens or padded, the op runs dense)
    sparse = {"early_sparse_p": 1.0, "early_sparse_window": 16} if rng.random() < 0.25 else {}
    for step in range(rng.randint(1, 3)):
        model, fast = pool.get(archs[step % len(archs)], dtype, p=1.0, **sparse)
        call = _random_inputs(rng, model, dtype)
        kwargs, spec = call["kwargs"], call["spec"]
        context, grad_free, tolerance_dtype = _grad_free(rng, dtype)
        result.detail = (f"call {step + 1} on {archs[step % len(archs)]}{' (early sparse)' if sparse else ''} "
                         f"under {context}: {spec}")
        with grad_free():
            try:
                ref_all = _call(model, model, kwargs, spec["positional"])
            except Exception as exc:  # noqa: BLE001  (the plain model refuses: not a case)
                return _plain_model_raised(result, exc)
            fast.backend.last_unaccelerated = None
            out_all = _call(fast, model, kwargs, spec["positional"])
        out, ref = out_all.logits, ref_all.logits
        bad = _compare_logits(out, ref, call["mask"], kwargs.get("logits_to_keep"), tolerance_dtype) \
            or _compare_extras(out_all, ref_all, kwargs, tolerance_dtype)
        tie = _rows_alone_tie(model, fast, out, ref, call["mask"], kwargs, tolerance_dtype, grad_free) if bad else None
        if tie:
            result.status, result.detail = "tie", f"{bad}; {tie}; {result.detail}"
            return result
        if bad:
            result.status, result.detail = "mismatch", f"{bad}; {result.detail}"
            return result
        if kind_of(fast.backend.last_unaccelerated) is Kind.REWRITE_FAILED:
            result.status, result.detail = "error", f"{fast.backend.last_unaccelerated}; {result.detail}"
            return result
        if _accelerated(fast):
            result.accelerated += 1
        elif fast.backend.last_unaccelerated:
            result.reasons.append(fast.backend.last_unaccelerated)
        elif spec["length"] >= MIN_TOKENS:
            result.status = "unexplained"
            result.detail = f"ran unaccelerated without a reason; {result.detail}"
            return result
        else:
            result.reasons.append("shorter than min_tokens")
    return result


def _rows_alone_tie(model, fast, out, ref, mask, kwargs, dtype, grad_free=torch.no_grad) -> str | None:
    """Where the compiled model prefilled a batch row by row (a batch that fills a cache) in bf16 arithmetic (`dtype`
    the tolerance's: a bf16 model, or an fp32 one under bf16 autocast) and its logits part from the plain model's
    batched ones: the plain model run the same way, each row alone with its pads stripped, under the call's context
    `grad_free` (autocast included), is the plain model's other answer. When it parts from the plain batch by more
    than the tolerance too, and the compiled logits equal it, rounding is the difference (the "tie" of
    `_tie_at_divergence`, for logits): the gap."""
    from ..runtime.batched import prefill_rows

    if dtype is not torch.bfloat16 or fast.row_histories is None:
        return None
    with grad_free():
        alone, _ = prefill_rows(model, lambda _ids, **step: type(model).forward(model, **step), lambda: None,
                                kwargs.get("input_ids"), kwargs)
    keep = kwargs.get("logits_to_keep")
    own_gap = _compare_logits(alone.logits, ref, mask, keep, dtype)
    if own_gap is None or _compare_logits(out, alone.logits, mask, keep, dtype) is not None:
        return None
    return (f"equal to the plain model's rows run one at a time, whose own batched bf16 logits part from them as "
            f"much ({own_gap}): rounding")


def _generate_case(rng, pool, case, arch, dtype, mode: str | None = None) -> CaseResult:
    from transformers import DynamicCache

    model, fast = pool.get(arch, dtype, p=1.0)
    mode = mode or rng.choice(["greedy", "sample", "beam", "return_sequences", "explicit cache", "static cache",
                       "prompt lookup", "next turn", "inputs_embeds", "chunked prefill", "mask inferred",
                       "stop tokens", "processors", "assistant model", "beam sample", "no cache",
                       "logits returned"])
    rows = rng.choice([1, 2])
    rows = 1 if mode in ("prompt lookup", "assistant model") else rows  # assisted generation takes one row
    length = rng.randint(MIN_TOKENS, 160)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(case))
    mask = torch.ones_like(ids)
    padding = rng.choice(["none", "left", "right"] + (["holes"] if rows == 1 else []))
    if padding == "left":
        for r in range(rows):
            mask[r, : rng.randint(0, length // 3)] = 0
        if rows > 1 and rng.random() < 0.3:  # a last row too short to drop: its prefill compiles after the others
            mask[-1, : length - rng.randint(4, 15)] = 0
    elif padding == "holes":
        mask[0, 5: rng.randint(6, length // 2)] = 0
    elif padding == "right":  # a last row whose prompt ends in pads (transformers warns, and answers)
        mask[-1, length - rng.randint(1, length // 3):] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(2, 5), pad_token_id=0)
    if mode == "sample":
        kwargs.update(do_sample=True, top_k=0, top_p=1.0)
    elif mode == "beam":
        beams = rng.choice([2, 3])
        kwargs.update(num_beams=beams, num_return_sequences=rng.randint(1, beams), do_sample=False)
    elif mode == "beam sample":  # beams whose next tokens are drawn (transformers' beam_sample)
        beams = rng.choice([2, 3])
        kwargs.update(num_beams=beams, num_return_sequences=rng.randint(1, beams), do_sample=True, top_k=0)
    elif mode == "return_sequences":
        kwargs.update(do_sample=True, num_return_sequences=2, top_k=0)
    elif mode == "static cache":
        kwargs.update(do_sample=False, cache_implementation="static")
    elif mode == "no cache":  # every step a forward over the whole sequence so far (a prefill each)
        kwargs.update(do_sample=False, use_cache=False)
    elif mode == "logits returned":  # every step's logits compared too, the first one the prefill's
        kwargs.update(do_sample=False, return_dict_in_generate=True, output_logits=True)
    elif mode == "prompt lookup":
        kwargs.update(do_sample=False, prompt_lookup_num_tokens=rng.choice([2, 3]))
    elif mode == "assistant model":  # the plain model drafts for itself
        kwargs.update(do_sample=False, assistant_model=model)
    elif mode == "chunked prefill":  # transformers' prefill_chunk_size: several prefill forwards, or one
        kwargs.update(do_sample=False, prefill_chunk_size=rng.choice([16, 48, length]))
    elif mode == "mask inferred":  # no attention_mask: generate infers it from the pad tokens (ids hold none else)
        kwargs.update(do_sample=False, input_ids=ids.masked_fill(mask == 0, 0))
        del kwargs["attention_mask"]
    elif mode == "stop tokens":  # an eighth of the vocabulary ends a row: rows stop early, one before the other
        kwargs.update(do_sample=False, eos_token_id=rng.sample(range(3, model.config.vocab_size),
                                                               max(1, model.config.vocab_size // 8)))
    elif mode == "processors":  # logits processors that read the prompt's tokens
        kwargs.update(do_sample=False, repetition_penalty=rng.choice([1.2, 2.0]), no_repeat_ngram_size=2,
                      min_new_tokens=2)
    else:
        kwargs.update(do_sample=False)
    if mode == "inputs_embeds":  # generate returns only the new tokens then
        kwargs["inputs_embeds"] = model.get_input_embeddings()(kwargs.pop("input_ids")).detach()
    turn = torch.randint(3, model.config.vocab_size, (rows, rng.randint(1, 80)),
                         generator=torch.Generator().manual_seed(case + 1)) if mode == "next turn" else None
    result = CaseResult(case, arch, f"generate {mode}", "equal",
                        detail=f"rows {rows}, length {length}, padding {padding}, {mode}"
                               + (f" (+{turn.shape[1]} tokens)" if turn is not None else ""))
    seed = rng.randrange(1 << 30)
    with torch.no_grad():
        try:
            torch.manual_seed(seed)
            extra = {"past_key_values": DynamicCache(config=model.config)} if mode == "explicit cache" else {}
            ref = model.generate(**kwargs, **extra) if turn is None else _next_turn(model, kwargs, turn)
        except Exception as exc:  # noqa: BLE001
            return _plain_model_raised(result, exc)
        torch.manual_seed(seed)
        extra = {"past_key_values": DynamicCache(config=model.config)} if mode == "explicit cache" else {}
        out = fast.generate(**kwargs, **extra) if turn is None else _next_turn(fast, kwargs, turn)
    logits_gap = None
    if mode == "logits returned":
        if torch.equal(out.sequences, ref.sequences):  # else the tokens part: the tie check below judges
            logits_gap = _compare_logits(torch.stack(out.logits, 1), torch.stack(ref.logits, 1),
                                         torch.ones(ref.sequences.shape[0], len(ref.logits)), None, dtype)
        out, ref = out.sequences, ref.sequences
    tie = None
    if not torch.equal(out, ref) and out.shape == ref.shape and mode in ("greedy", "explicit cache", "beam",
                                                                         "next turn", "chunked prefill",
                                                                         "mask inferred", "processors",
                                                                         "stop tokens", "static cache", "no cache",
                                                                         "logits returned"):
        tie = _tie_at_divergence(model, out, ref, mask, length, dtype, _processors(kwargs))
    if logits_gap is not None:
        result.status, result.detail = "mismatch", f"the returned logits: {logits_gap}; {result.detail}"
    elif not torch.equal(out, ref) and tie is None:
        result.status = "mismatch"
        new = slice(0 if mode == "inputs_embeds" else length, None)
        again = _plain_again(model, kwargs, seed, mode, turn)
        again = "the same" if again is not None and torch.equal(again, ref) else \
            "not comparable" if again is None or again.shape != ref.shape else \
            f"{again[:, new].tolist()}: its answer does not repeat"
        result.detail = f"tokens {out[:, new].tolist()} vs {ref[:, new].tolist()} (the plain model again from the " \
                        f"same seed: {again}); {result.detail}"
    elif tie is not None:
        result.status, result.detail = "tie", f"{tie}; {result.detail}"
        result.accelerated = int(_accelerated(fast))
    elif kind_of(fast.backend.last_unaccelerated) is Kind.REWRITE_FAILED:
        result.status, result.detail = "error", f"{fast.backend.last_unaccelerated}; {result.detail}"
    elif _accelerated(fast):
        result.accelerated += 1
    elif fast.backend.last_unaccelerated:
        result.reasons.append(fast.backend.last_unaccelerated)
    return result


def _plain_again(model, kwargs: dict, seed: int, mode: str, turn) -> torch.Tensor | None:
    """The plain model's tokens once more from the same seed, after a mismatch: a reference that does not repeat
    its own answer (process state moving its numerics) is named in the case's detail. None if it raised."""
    from transformers import DynamicCache

    try:
        with torch.no_grad():
            torch.manual_seed(seed)
            extra = {"past_key_values": DynamicCache(config=model.config)} if mode == "explicit cache" else {}
            again = model.generate(**kwargs, **extra) if turn is None else _next_turn(model, kwargs, turn)
    except Exception:  # noqa: BLE001  (it answered the first time: the detail says "not comparable")
        return None
    return again.sequences if mode == "logits returned" else again


def _next_turn(target, kwargs: dict, turn: torch.Tensor) -> torch.Tensor:
    """A chat's next turn through `generate` (transformers' cache re-use): greedy on the prompt, then greedy again
    on its output followed by `turn`, given the first call's cache. The second call's sequences (both turns)."""
    first = target.generate(**kwargs, return_dict_in_generate=True)  # kwargs: greedy
    ids = torch.cat([first.sequences, turn], dim=1)
    mask = torch.cat([kwargs["attention_mask"], torch.ones(ids.shape[0], ids.shape[1] - kwargs["input_ids"].shape[1],
                                                           dtype=kwargs["attention_mask"].dtype)], dim=1)
    return target.generate(input_ids=ids, attention_mask=mask, past_key_values=first.past_key_values,
                           max_new_tokens=kwargs["max_new_tokens"], pad_token_id=0, do_sample=False)


def _processors(kwargs: dict):
    """The logits processors `generate` applies for the "processors" mode's settings, as `(ids, logits) -> scores`
    (None for the other modes): greedy picks the highest processed score, so a tie is judged on those."""
    if "repetition_penalty" not in kwargs:
        return None
    from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(kwargs["repetition_penalty"]),
                                 NoRepeatNGramLogitsProcessor(kwargs["no_repeat_ngram_size"])])
    return lambda ids, logits: chain(ids, logits[None])[0]


def _tie_at_divergence(model, out, ref, mask, length: int, dtype, process=None) -> str | None:
    """Where greedy or beam tokens first differ, whether the plain model itself scores the two
    tokens within the dtype's tolerance (a tie that rounding flips: row-by-row prefill of a
    padded batch computes the same logits in a different order). `process(ids, logits)`: the logits
    processors greedy decoding ran, applied to the plain model's logits before the two tokens are
    compared (a token they banned is never a tie). None: a real mismatch."""
    differ = (out != ref).nonzero()
    row, pos = int(differ[0, 0]), int(differ[0, 1])
    if pos < length:
        return None
    per_row = out.shape[0] // mask.shape[0]
    prefix = ref[row:row + 1, :pos]
    prefix_mask = torch.cat([mask[row // per_row:row // per_row + 1],
                             torch.ones(1, pos - length, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=prefix, attention_mask=prefix_mask, use_cache=False).logits[0, -1].float()
    if process is not None:
        logits = process(prefix, logits)
    gap = float((logits[ref[row, pos]] - logits[out[row, pos]]).abs())
    if gap != gap or gap == float("inf"):  # a token the processors banned (-inf): no tie
        return None
    tol = TOLERANCE[dtype] * max(1.0, float(logits[logits.isfinite()].abs().max()))
    if gap > tol:
        return None
    return (f"tokens first differ at row {row}, step {pos - length + 1}: the plain model scores them "
            f"{gap:.3g} apart (tolerance {tol:.3g}), a tie")


def _decode_case(rng, pool, case, arch, dtype) -> CaseResult:
    """A prefill into a cache object passed in (one row), or of a batch of two rows that fills the cache it returns
    (prefilled row by row), then steps through the same forward: one token, or several (a chat's next turn, a
    chunked continuation)."""
    from transformers import DynamicCache

    model, fast = pool.get(arch, dtype, p=1.0)
    rows = rng.choice([1, 1, 2])
    length = rng.randint(MIN_TOKENS, 200)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(case))
    mask = torch.ones_like(ids)
    if rng.random() < 0.4:
        mask[-1, : rng.randint(1, length // 3)] = 0
    elif rows > 1 and rng.random() < 0.3:  # a last row too short to drop
        mask[-1, : length - rng.randint(4, 15)] = 0
    by_embeds = rng.random() < 0.2  # the steps' tokens given as inputs_embeds (a soft prompt, a multimodal turn)
    result = CaseResult(case, arch, "forward + decode steps", "equal",
                        detail=f"rows {rows}, length {length}, pads {int((mask == 0).sum())}"
                               + (", steps as inputs_embeds" if by_embeds else ""))
    with torch.no_grad():
        if rows == 1:
            mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
            out = fast(input_ids=ids, attention_mask=mask, past_key_values=mine, use_cache=True).logits
            ref = model(input_ids=ids, attention_mask=mask, past_key_values=theirs, use_cache=True).logits
        else:  # no cache object: the batch is prefilled row by row, and its output carries their caches
            out, ref = fast(input_ids=ids, attention_mask=mask, use_cache=True), model(
                input_ids=ids, attention_mask=mask, use_cache=True)
            (out, mine), (ref, theirs) = (out.logits, out.past_key_values), (ref.logits, ref.past_key_values)
        bad = _compare_logits(out, ref, mask, None, dtype)
        tie = _rows_alone_tie(model, fast, out, ref, mask, {"input_ids": ids, "attention_mask": mask,
                                                             "use_cache": True}, dtype) if bad and rows > 1 else None
        if tie is not None:  # the plain model parts from its own rows alone as much: no steps on top of that
            result.status, result.detail = "tie", f"{tie}; {result.detail}"
            result.accelerated = int(_accelerated(fast))
            return result
        accelerated = _accelerated(fast)
        # a model with recurrent layers: the plain model fed each step's tokens one at a time too (a compacted cache
        # continues so, `continuation.recurrent_layers`; the plain several-token step may differ, tiny Jamba's)
        one_at_a_time = copy.deepcopy(theirs) if recurrent_layers(model) else None
        for step in range(rng.randint(1, 3)):
            if bad:
                break
            token = ref[:, -1:].argmax(-1)
            width = rng.choice([1, 1, 3])
            if width > 1:
                token = torch.cat([token, torch.randint(3, model.config.vocab_size, (rows, width - 1),
                                                        generator=torch.Generator().manual_seed(case + step))], dim=1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            new = {"inputs_embeds": model.get_input_embeddings()(token)} if by_embeds else {"input_ids": token}
            out = fast(**new, attention_mask=mask, past_key_values=mine, use_cache=True).logits
            ref = model(**new, attention_mask=mask, past_key_values=theirs, use_cache=True).logits
            bad = _compare_logits(out, ref, torch.ones_like(token), None, dtype)
            if one_at_a_time is not None:
                steps = torch.cat([model(input_ids=token[:, i:i + 1], past_key_values=one_at_a_time, use_cache=True,
                                         attention_mask=mask[:, :mask.shape[1] - width + 1 + i]).logits
                                   for i in range(width)], dim=1)
                bad = bad and _compare_logits(out, steps, torch.ones_like(token), None, dtype)
            if bad:
                bad = f"decode step {step + 1}: {bad}"
    if bad:
        result.status, result.detail = "mismatch", f"{bad}; {result.detail}"
    elif kind_of(fast.backend.last_unaccelerated) is Kind.REWRITE_FAILED:
        result.status, result.detail = "error", f"{fast.backend.last_unaccelerated}; {result.detail}"
    elif accelerated:
        result.accelerated = 1
    elif fast.backend.last_unaccelerated:
        result.reasons.append(fast.backend.last_unaccelerated)
    return result
