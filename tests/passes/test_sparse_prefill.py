"""Block-sparse attention before the first drop point (config.early_sparse_*; issue 22, Part 2).

The pattern (`kernels.sparse_attention.select_key_blocks`), its two runners (flex_attention and
the PyTorch reference), the `uniprefill::sparse_attention` op's dense fallbacks, the rewrite
that puts it into a graph, and the CLI / config surface.
"""

from __future__ import annotations

import math

import pytest
import torch

import uniprefill
import uniprefill.ops  # noqa: F401  (registers torch.ops.uniprefill)
from uniprefill import UniPrefillConfig
from uniprefill.kernels import sparse_attention as S

from .test_backend import _llama

SMALL = dict(sink=16, last_q=16, block_size=16)


def _qkv(b=1, h=4, hk=2, n=700, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=gen), torch.randn(b, hk, n, d, generator=gen),
            torch.randn(b, hk, n, d, generator=gen))


def _causal_blocks(nb):
    return torch.ones(nb, nb, dtype=torch.bool).tril()


@pytest.mark.parametrize("rule", [dict(p=1.0), dict(keep=1.0)])
def test_full_selection_is_every_causal_block(rule):
    q, k, _ = _qkv()
    blocks, density = S.select_key_blocks(q, k, 0.2, last_q=16, sink=16, window=64, block_size=64, **rule)
    assert torch.equal(blocks, _causal_blocks(11).expand(1, 4, 11, 11))
    assert float(density) == 1.0


def test_pattern_holds_sink_band_and_diagonal_and_nothing_above_it():
    q, k, _ = _qkv(n=1000)
    blocks, density = S.select_key_blocks(q, k, 0.2, last_q=16, sink=100, window=64, block_size=64, keep=0.1)
    nb = math.ceil(1000 / 64)
    i, j = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    assert not (blocks & (j > i)).any()
    assert blocks[:, :, (j < 2) & (j <= i)].all()  # the sink's 2 blocks
    band = (j <= i) & (i - j <= 1)
    assert blocks[:, :, band].all()
    # vertical blocks: ceil(0.1 * free) per head, free = blocks outside the 2 sink blocks and the last band
    free = nb - 2 - 2
    vertical = blocks[:, :, -1, 2:nb - 2].sum(-1)
    assert torch.equal(vertical, torch.full_like(vertical, math.ceil(0.1 * free)))
    assert 0 < float(density) < 1
    assert float(density) == pytest.approx(blocks.sum().item() / (4 * nb * (nb + 1) / 2))


def test_top_p_keeps_the_block_the_last_queries_attend_to():
    """A key block made to match the last queries is selected at a small p; the rest are not."""
    q, k, _ = _qkv(h=2, hk=1, n=1024, d=16)
    target = q[0, :, -16:].mean(dim=(0, 1))  # the direction every last query shares
    k[0, 0, 5 * 64:6 * 64] = 8 * target / target.norm()
    blocks, _ = S.select_key_blocks(q, k, 1.0, last_q=16, sink=0, window=0, block_size=64, p=0.5)
    chosen = blocks[0, :, -1, :-1]  # the last query block's keys before its own block
    assert chosen[:, 5].all()
    assert chosen.sum(-1).max() <= 3


@pytest.mark.parametrize("shape", [(1, 4, 2, 700), (2, 4, 4, 515), (1, 2, 1, 1024)])
def test_flex_equals_the_reference(shape):
    b, h, hk, n = shape
    q, k, v = _qkv(b, h, hk, n, 16)
    blocks, _ = S.select_key_blocks(q, k, 0.25, last_q=32, sink=16, window=64, block_size=64, keep=0.2)
    assert not blocks.all()
    mask = S.flex_block_mask(blocks, n, 64)
    assert torch.equal(mask.to_dense().bool(), blocks)  # the kv lists hold exactly the pattern
    flex = S.block_sparse_attention(q, k, v, blocks, scale=0.25, impl="flex", block_size=64)
    ref = S.block_sparse_attention_reference(q, k, v, blocks, 64, 0.25)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=0)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=h != hk)
    assert (ref - dense).abs().max() > 1e-2  # the pattern really leaves keys out


def test_bad_settings_are_refused():
    q, k, _ = _qkv(n=300)
    with pytest.raises(ValueError, match="exactly one"):
        S.select_key_blocks(q, k, 0.2, last_q=16, sink=16, window=64, p=0.9, keep=0.1)
    with pytest.raises(ValueError, match="keep=1.5"):
        S.select_key_blocks(q, k, 0.2, last_q=16, sink=16, window=64, keep=1.5)
    with pytest.raises(ValueError, match="early_sparse_p=0.9 and early_sparse_keep=0.1"):
        UniPrefillConfig(early_sparse_p=0.9, early_sparse_keep=0.1)
    with pytest.raises(ValueError, match="early_sparse_keep"):
        UniPrefillConfig(early_sparse_keep=0.0)
    with pytest.raises(ValueError, match="early_sparse_window"):
        UniPrefillConfig(early_sparse_p=0.9, early_sparse_window=-1)


def test_config_digest_unchanged_when_off():
    assert UniPrefillConfig(p=0.9, drop_layers=(5, 11), selection="paper").stable_hash() == "2c5a428df294363f"
    on = UniPrefillConfig(early_sparse_keep=0.1)
    assert on.early_sparse and not UniPrefillConfig().early_sparse
    assert on.stable_hash() != UniPrefillConfig().stable_hash()
    assert on.stable_hash() != UniPrefillConfig(early_sparse_keep=0.1, early_sparse_window=512).stable_hash()


def test_op_runs_dense_for_padded_rows_and_short_prompts():
    q, k, v = _qkv(b=2, n=600)
    valid = torch.ones(2, 600, dtype=torch.bool)
    valid[1, :40] = False
    mask = torch.ops.uniprefill.dense_mask(q, valid, 0)
    dense = torch.ops.uniprefill.dense_attention(q, k, v, valid, 0, 0.2, True, mask)
    out, density = torch.ops.uniprefill.sparse_attention(q, k, v, valid, mask, 0.2, 1.0, 0.1, 128, 16, 16, 0, "auto")
    assert float(density) == 1.0
    torch.testing.assert_close(out, dense, atol=0, rtol=0)
    out, density = torch.ops.uniprefill.sparse_attention(q, k, v, None, None, 0.2, 1.0, 0.1, 128, 16, 16, 1000, "auto")
    assert float(density) == 1.0  # shorter than min_tokens
    out, density = torch.ops.uniprefill.sparse_attention(q, k, v, None, None, 0.2, 1.0, 0.1, 0, 16, 16, 0, "auto")
    assert float(density) < 1.0


def test_at_full_density_the_model_is_unchanged_batch_and_padding():
    model = _llama()
    ids = torch.randint(0, 128, (2, 700), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    compiled = uniprefill.compile(model, UniPrefillConfig(p=1.0, drop_layers=(2,), early_sparse_p=1.0, **SMALL))
    with torch.no_grad():
        for m in (None, mask):
            ref = model(input_ids=ids, attention_mask=m, use_cache=False).logits
            out = compiled(input_ids=ids, attention_mask=m, use_cache=False).logits
            torch.testing.assert_close(out[:, -1], ref[:, -1], atol=1e-4, rtol=0)
    report = uniprefill.graph_reports(compiled)[-1]
    assert report.counts["sparse_attention"] == 3  # layers 0, 1 and the drop layer 2
    assert report.counts["dense_attention"] == 0


def test_forced_density_drops_blocks_and_reports_them():
    model = _llama()
    ids = torch.randint(0, 128, (1, 1100), generator=torch.Generator().manual_seed(4))
    compiled = uniprefill.compile(model, UniPrefillConfig(
        p=1.0, drop_layers=(2,), early_sparse_keep=0.1, early_sparse_window=128, **SMALL))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[:, -1]
        out = compiled(input_ids=ids, use_cache=False).logits[:, -1]
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() > 1e-4  # attention really was sparse
    history = uniprefill.last_drop_report(compiled)
    density = history.sparse_density()
    assert sorted(density) == [0, 1, 2]
    assert all(0 < d < 1 for d in density.values())
    assert history.as_dict()["sparse_density"] == density


def test_cli_parses_early_sparse():
    from uniprefill.cli import build_parser
    from uniprefill.cli.arguments import UsageError, _configs

    args = build_parser().parse_args(["bench", "--early-sparse", "off,keep=0.1,p=0.9", "--early-sparse-window", "512"])
    configs = _configs(args)
    assert [(c.early_sparse_p, c.early_sparse_keep) for c in configs] == [(None, None), (None, 0.1), (0.9, None)]
    assert {c.early_sparse_window for c in configs} == {512}
    with pytest.raises(UsageError, match="--early-sparse"):
        _configs(build_parser().parse_args(["bench", "--early-sparse", "q=0.1"]))


@pytest.mark.gpu
def test_compiled_flex_equals_the_reference_on_cuda():
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(1, 8, 2, 4000, 64))
    blocks, density = S.select_key_blocks(q, k, 0.125, last_q=64, sink=128, window=256, keep=0.2)
    assert float(density) < 0.8
    flex = S.block_sparse_attention(q, k, v, blocks, scale=0.125, impl="flex")
    ref = S.block_sparse_attention_reference(q, k, v, blocks, S.SPARSE_BLOCK, 0.125)
    torch.testing.assert_close(flex.float(), ref.float(), atol=2e-2, rtol=0)
