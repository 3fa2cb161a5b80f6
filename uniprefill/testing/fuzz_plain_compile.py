"""The fuzzer's plain-`torch.compile` door: the same random calls as `_forward_case`, through
`torch.compile(model, backend="uniprefill", options=...)` (the module dynamo returns) or transformers' idiom
`model.forward = torch.compile(model.forward, ...)`, and `generate` through `model.compile(backend="uniprefill",
...)`, the in-place form whose `generate` reaches the compiled forward, or through that idiom.

Three cases in seven add torch.compile's own keywords as a user might (`dynamic=True`, `dynamic=False`: a graph per
shape, `fullgraph=True`); where the call raises under `fullgraph=True`, the case is "invalid" only if the plain model
compiled by dynamo's "eager" backend with the same keywords raises too (the model's own graph break), else "error".

A fifth of the forward calls mark their length axis dynamic first (`torch._dynamo.maybe_mark_dynamic`, the
caller's way to avoid a recompile per length): dynamo then traces the rows as a constant.

What is checked is what `_forward_case` checks, under the same drawn contexts (`no_grad`, `inference_mode`, bf16
autocast: `_grad_free`): at p = 1 the logits equal the plain model's at every real token, and a call long enough
to drop either ran the rewritten graph or says why (`backend.last_unaccelerated`). The backend's latest report is cleared before each call, so a call that
reached no graph of this backend (dynamo ran it uncompiled) leaves nothing and counts as unexplained.
Under plain torch.compile a call that fills a cache (`use_cache` left at its default, and every
`generate`) runs unaccelerated by design, with that reason.

Dynamo runs a frame uncompiled once it has compiled it `recompile_limit` (8) times; the fuzzer's random
argument forms pass that within a few cases, and such a call neither reaches the backend nor can be told
apart from one the backend lost. So this door's calls run with the limit at `RECOMPILE_LIMIT`, and the
pool is reset every `fresh_every` cases. What a user meets past the default limit (plain answers,
unaccelerated, a stale `last_drop_report`) is documented in the README.
"""

from __future__ import annotations

import torch

from ..unaccelerated import Kind, kind_of
from .fuzz_cases import (MIN_TOKENS, CaseResult, _call, _compare_extras, _compare_logits, _grad_free,
                         _plain_model_raised, _random_inputs)

RECOMPILE_LIMIT = 64


def _clear_reports(compiled) -> None:
    from ..backend import _backend_of

    try:
        backend = _backend_of(compiled)
    except ValueError:  # not run yet: nothing to clear
        return
    backend.recorder.last = None
    backend.last_unaccelerated = None


def _outcome(compiled, length: int, result: CaseResult) -> str | None:
    """None when the call is accounted for (accelerated, or a reason); else the failure's status."""
    from ..backend import _backend_of

    try:
        backend = _backend_of(compiled)
    except ValueError:
        backend = None
    history = backend.recorder.last if backend is not None else None
    reason = backend.last_unaccelerated if backend is not None else None
    if kind_of(reason) is Kind.REWRITE_FAILED:
        result.detail = f"{reason}; {result.detail}"
        return "error"
    if history is not None and history.points:
        result.accelerated += 1
    elif reason:
        result.reasons.append(str(reason))
    elif length >= MIN_TOKENS:
        result.detail = f"ran without reaching the backend and without a reason; {result.detail}"
        return "unexplained"
    else:
        result.reasons.append("shorter than min_tokens")
    return None


def _mark_length_dynamic(kwargs: dict, length: int) -> int:
    """`torch._dynamo.maybe_mark_dynamic(t, 1)` on the call's tensors of that length on axis 1 (ids, a 2-D mask,
    position ids, embeddings): a trace with a symbolic length and a constant row count, as dynamo's automatic dynamic
    shapes also give after a length changed and the rows did not (fuzz round 19c). Returns how many were marked."""
    marked = 0
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and 2 <= value.dim() <= 3 and value.shape[1] == length:
            torch._dynamo.maybe_mark_dynamic(value, 1)
            marked += 1
    return marked


def _plain_compile_case(rng, pool, case, arch, dtype) -> CaseResult:
    if rng.random() < 0.25:
        return _plain_compile_generate(rng, pool, case, arch, dtype)
    result = CaseResult(case, arch, "forward (torch.compile)", "equal")
    # a quarter of the cases come through transformers' idiom (the forward compiled and set on the model); a third
    # alternate with a second model of the class, compiled apart with equal options (after the module door dynamo
    # runs both through one graph), and each must report its own calls. The door draws shifted the random stream
    # on 2026-12-06: seeds of earlier rounds replay other cases from then on
    doors = ["method" if rng.random() < 0.25 else "module"] + (["module twin"] if rng.random() < 0.3 else [])
    flags = _draw_flags(rng)  # drawn since 2026-12-07: seeds of earlier rounds replay other cases from then on
    for step in range(rng.randint(1, 3)):
        model, compiled = pool.get_plain(arch, dtype, doors[step % len(doors)], flags)
        call = _random_inputs(rng, model, dtype)
        kwargs, spec = call["kwargs"], call["spec"]
        if rng.random() < 0.2:  # the caller marks the length dynamic (a recompile per length avoided), not the rows
            spec["marked"] = _mark_length_dynamic(kwargs, spec["length"])
        context, grad_free, tolerance_dtype = _grad_free(rng, dtype)
        result.detail = f"call {step + 1} ({doors[step % len(doors)]}{_flags_text(flags)}) under {context}: {spec}"
        with grad_free(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            try:
                ref = _call(model, model, kwargs, spec["positional"])
            except Exception as exc:  # noqa: BLE001  (the plain model refuses: not a case)
                return _plain_model_raised(result, exc)
            _clear_reports(compiled)
            try:
                out = _call(compiled, model, kwargs, spec["positional"])
            except Exception as exc:  # noqa: BLE001
                return _raised_under_flags(result, exc, flags, lambda flags: _call(
                    torch.compile(_fresh(arch, dtype), backend="eager", **flags), model, kwargs, spec["positional"]))
        bad = _compare_logits(out.logits, ref.logits, call["mask"], kwargs.get("logits_to_keep"), tolerance_dtype) \
            or _compare_extras(out, ref, kwargs, tolerance_dtype)
        if bad:
            result.status, result.detail = "mismatch", f"{bad}; {result.detail}"
            return result
        failure = _outcome(compiled, spec["length"], result)
        if failure:
            result.status = failure
            return result
    return result


def _draw_flags(rng) -> tuple:
    """torch.compile keywords of the case, as sorted (name, value) pairs: none in four cases of seven, each keyword
    in one."""
    return rng.choice([(), (), (), (), (("dynamic", True),), (("dynamic", False),), (("fullgraph", True),)])


def _flags_text(flags: tuple) -> str:
    return "".join(f", {name}={value}" for name, value in flags)


def _raised_under_flags(result: CaseResult, exc: Exception, flags: tuple, call_eager) -> CaseResult:
    """The compiled call raised. Under `fullgraph=True`, `call_eager(flags)` makes the same call through a new model
    of the case (`_fresh`: as the compiled copy was when compiled; a model that already ran can skip code a first call
    runs, such as transformers' output-capturing hooks installed under a lock) compiled by dynamo's "eager" backend
    with the same keywords: if it raises too, the model breaks its graph whatever the backend, the user's flag cannot
    hold, and the case is "invalid"; otherwise (and without fullgraph) the raise is re-raised, for `run_case` to count
    as an error."""
    if dict(flags).get("fullgraph"):
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                call_eager(dict(flags))
        except Exception as eager_exc:  # noqa: BLE001
            result.status = "invalid"
            result.detail = (f"fullgraph=True raises under dynamo's eager backend too: {type(eager_exc).__name__}: "
                             f"{str(eager_exc)[:200]}; {result.detail}")
            return result
    raise exc


def _plain_compile_generate(rng, pool, case, arch, dtype) -> CaseResult:
    """`generate` on a model compiled in place (`model.compile(...)`, or its forward compiled and set on it):
    greedy or beam, padded or not; tokens must equal the plain model's. Its calls fill caches, so they run
    unaccelerated with that reason (checked: never silently)."""
    door = rng.choice(["in place", "method"])
    flags = _draw_flags(rng)
    model, compiled = pool.get_plain(arch, dtype, door, flags)
    rows = rng.choice([1, 2])
    length = rng.randint(MIN_TOKENS, 160)
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(case))
    mask = torch.ones_like(ids)
    if rows > 1 and rng.random() < 0.5:
        mask[1, : rng.randint(1, length // 3)] = 0
    beams = rng.choice([1, 1, 2])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(2, 4), pad_token_id=0,
                  do_sample=False, num_beams=beams)
    result = CaseResult(case, arch, f"generate ({'model.compile' if door == 'in place' else 'compiled forward'})",
                        "equal",
                        detail=f"rows {rows}, length {length}, beams {beams}, left-padded {bool((mask == 0).any())}"
                               f"{_flags_text(flags)}")
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        try:
            ref = model.generate(**kwargs)
        except Exception as exc:  # noqa: BLE001
            return _plain_model_raised(result, exc)
        _clear_reports(compiled)
        try:
            out = compiled.generate(**kwargs)
        except Exception as exc:  # noqa: BLE001
            return _raised_under_flags(result, exc, flags, lambda flags: _eager_generate(arch, dtype, kwargs, flags))
    if not torch.equal(out, ref):
        from .fuzz_cases import _tie_at_divergence

        tie = _tie_at_divergence(model, out, ref, mask, length, dtype) if out.shape == ref.shape else None
        result.status = "tie" if tie else "mismatch"
        result.detail = f"{tie or f'tokens {out[:, length:].tolist()} vs {ref[:, length:].tolist()}'}; {result.detail}"
        return result
    failure = _outcome(compiled, length, result)
    if failure:
        result.status = failure
    return result


def _fresh(arch: str, dtype: torch.dtype):
    """A new model of the case, equal to the pooled plain model before it ran (`build_model` is seeded)."""
    from .fuzz import build_model

    return build_model(arch, dtype)


def _eager_generate(arch: str, dtype: torch.dtype, kwargs: dict, flags: dict):
    """`generate` of a new model of the case compiled in place by dynamo's "eager" backend with `flags`."""
    model = _fresh(arch, dtype)
    model.compile(backend="eager", **flags)
    return model.generate(**kwargs)
