"""The plain model, called by another thread while `UniPrefillModel.generate` runs on it. `generate` routes
`model.forward` through the wrapper and decode steps switch the model's attention to "uniprefill_decode"; both
are visible to every thread. Before: the plain model's `generate` in a second thread ran through the wrapper and
returned the DROPPED answer (2 of 2 runs, keep 0.3); with the routing kept to the wrapper's threads, a call that
landed inside a decode step raised. Now the routing serves only the threads that run the wrapper's `generate`,
and a plain call inside a decode step runs the model's own SDPA attention."""

from __future__ import annotations

import threading

import pytest
import torch

import uniprefill
from uniprefill import UniPrefillConfig

from ..passes.test_backend import MODELS, SMALL, _ids


@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_the_plain_model_in_another_thread_answers_as_the_plain_model_while_the_wrapper_generates(arch):
    build, drops = MODELS[arch]
    model = build()
    fast = uniprefill.compile(model, UniPrefillConfig(keep_ratio=0.3, drop_layers=drops, **SMALL))
    ids = _ids(1, 300)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain_ref, fast_ref = model.generate(ids, **kwargs), fast.generate(ids, **kwargs)
    assert not torch.equal(plain_ref, fast_ref)  # the drop changes the answer: a routed plain call would show
    outs, errors = {}, []

    def run(name, target):
        try:
            with torch.no_grad():
                outs[name] = target.generate(ids, **kwargs)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f"{kind}{i}", target))
               for i in range(2) for kind, target in (("fast", fast), ("plain", model))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, out in outs.items():
        assert torch.equal(out, fast_ref if name.startswith("fast") else plain_ref), name
    assert "forward" not in vars(model) and model.config._attn_implementation == "sdpa"
    assert not hasattr(model.config, "_uniprefill_plain_attention")
