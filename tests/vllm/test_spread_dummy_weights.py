"""`word_llama.spread_dummy_weights`: the refill that makes a dummy-weight parity run depend on the prompt."""

import torch

from uniprefill.testing.word_llama import spread_dummy_weights


class _Worker:  # vLLM's worker as the function reads it: `model_runner.get_model()`
    def __init__(self, model):
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model})()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1e-3, 1e-3)  # as vLLM's dummy loader
    return model


def test_matrices_are_refilled_alike_in_two_engines_and_vectors_keep_their_values():
    a, b = _model(), _model()
    norm_before = a[1].weight.clone()
    assert spread_dummy_weights(_Worker(a), std=0.02, seed=3) == 2  # the embedding and the linear weight
    spread_dummy_weights(_Worker(b), std=0.02, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(a[1].weight, norm_before) and a[2].bias.abs().max() <= 1e-3
    assert 0.015 < float(a[0].weight.std()) < 0.025 and 0.015 < float(a[2].weight.std()) < 0.025
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits = a(ids)
    assert not torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))  # the answer depends on the input now
    c = _model()
    spread_dummy_weights(_Worker(c), std=0.02, seed=4)
    assert not torch.equal(c[0].weight, a[0].weight)
