"""`TokenAxes.int_index_axis`: which token axis a getitem reads with a plain integer (a Python loop
unrolled over the prompt, which the token-drop pass refuses after a drop point)."""

from __future__ import annotations

import pytest
import torch

from uniprefill.passes.fx_utils import TokenAxes

AXES = TokenAxes(batch=1, seq=7, static=True)
VALUE = torch.zeros(1, 7, 4)  # [batch, tokens, hidden]


@pytest.mark.parametrize("index, axis", [
    ((slice(None), 3), 1),  # h[:, 3]: one token
    (3, None),  # h[3]: the batch axis
    ((slice(None), slice(None), 2), None),  # a hidden channel
    ((None, slice(None), 3), 2),  # a new axis first: the token axis is the index's third item
    ((Ellipsis, 3), None),  # h[..., 3]: the last axis (hidden)
    ((Ellipsis, 3, slice(None)), 1),  # h[..., 3, :]: the token axis counted from the end
    ((slice(None), True), None),  # a bool is a mask, not a position
    ((slice(None), slice(2, 5)), None),  # a slice keeps a run of tokens
])
def test_an_integer_on_the_token_axis_is_found(index, axis):
    assert AXES.int_index_axis(VALUE, index) == axis


def test_a_value_without_a_token_axis_reads_no_token():
    assert AXES.int_index_axis(torch.zeros(1, 3, 4), (slice(None), 2)) is None
    assert AXES.int_index_axis(None, 0) is None
