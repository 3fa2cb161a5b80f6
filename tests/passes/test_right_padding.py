"""Right padding: a row whose last position is a pad. The method's answer is the last position's, and the first
drop keeps real tokens only, so the pad's state there was the state it had when dropped: at p = 1 the compiled
model answered otherwise than the plain model at every pad, the last position included, and `generate` on a
right-padded Gemma-3 prompt chose other tokens (found by probing padding the fuzzer did not draw). Such calls now
run unaccelerated, saying why; the fuzzer draws right padding and compares every row's last position."""

from __future__ import annotations

import pytest
import torch

import uniprefill
from uniprefill import UniPrefillConfig
from uniprefill.unaccelerated import Kind

from .test_backend import MODELS, SMALL, _ids


def _right_padded(rows: int, length=300, real=240):
    ids = _ids(rows, length)
    mask = torch.ones_like(ids)
    mask[-1, real:] = 0
    return ids, mask


@pytest.mark.parametrize("door", ["uniprefill.compile", "torch.compile"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_a_row_that_ends_in_padding_runs_unaccelerated_and_equals_the_plain_model_at_every_position(arch, rows, door):
    build, drops = MODELS[arch]
    model = build()
    ids, mask = _right_padded(rows)
    if door == "uniprefill.compile":
        fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, **SMALL))
    else:
        fast = torch.compile(model, backend="uniprefill", options=dict(p=1.0, drop_layers=drops, **SMALL))
    with pytest.warns(UserWarning, match="ends in padding"):
        out = fast(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    backend = uniprefill.backend._backend_of(fast)
    assert backend.last_unaccelerated.kind is Kind.INPUT_NOT_MODELLED and uniprefill.last_drop_report(fast) is None
    # the same rows padded on the left drop (and equal at every real token and the last position)
    left = mask.flip(-1)
    shifted = torch.where(left.bool(), ids.roll(ids.shape[1] - int(mask[-1].sum()), dims=-1), ids)
    out = fast(input_ids=shifted, attention_mask=left, use_cache=False).logits
    assert uniprefill.last_drop_report(fast).points
    torch.testing.assert_close(out[:, -1], model(input_ids=shifted, attention_mask=left, use_cache=False).logits[:, -1],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_generate_from_a_right_padded_prompt_equals_the_plain_model(arch):
    build, drops = MODELS[arch]
    model = build()
    fast = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=drops, **SMALL))
    ids, mask = _right_padded(1, real=210)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    out, ref = fast.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.logits, ref.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert "ends in padding" in fast.backend.last_unaccelerated


@pytest.mark.parametrize("left_padding_only", [False, True])
def test_the_padding_mask_checks_name_the_first_unsound_row_shape_in_one_pass(left_padding_only):
    """`failed_check` on a padding mask: an all-pad row, a row ending in padding, and (for models with convolutions
    or scans) padding after a real token, each with its reason; left padding passes."""
    from uniprefill.passes.mask_inputs import InputCheck, InputRole, failed_check

    check = (InputCheck(0, InputRole.PADDING, "attention_mask"),)
    masks = {"left": [[0, 0, 1, 1], [1, 1, 1, 1]], "all pad": [[0, 0, 0, 0], [1, 1, 1, 1]],
             "right": [[1, 1, 1, 0], [1, 1, 1, 1]], "hole": [[1, 0, 1, 1], [1, 1, 1, 1]]}
    why = {name: failed_check(check, (torch.tensor(m),), 2, 4, left_padding_only) for name, m in masks.items()}
    assert why["left"] is None
    assert "holds no real token" in why["all pad"] and "ends in padding" in why["right"]
    assert ("convolutions or scans" in why["hole"]) if left_padding_only else why["hole"] is None
