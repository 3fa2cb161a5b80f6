"""Score-and-select kernels: Triton vs the PyTorch reference vs a brute-force formula.

Without CUDA the Triton kernels run in Triton's CPU interpreter. Triton picks interpreter or
compiler when it decorates a function, its own `triton.language` helpers included, i.e. when
triton is first imported; so tests/conftest.py sets TRITON_INTERPRET=1 before any test module
is imported, and the autouse fixture here fails every test loudly if triton was nevertheless
imported in compiled mode. With CUDA the same tests run on the GPU, plus the `gpu` tests at
Llama-3.1-8B shapes.
"""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

from uniprefill.kernels import api
from uniprefill.kernels.score_blocks import reference as score_reference
from uniprefill.kernels.select_blocks import reference as select_reference
from uniprefill.kernels.rule import SelectionRule
from uniprefill.kernels.select_blocks.kernel import MAX_BLOCKS_PER_SEQUENCE
from uniprefill.kernels.validation import read_layout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ||out - ref|| / ||ref|| on block scores, by input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def _triton_on_this_machine(monkeypatch):
    if DEVICE.type != "cpu":
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    standard = sys.modules["triton.language.standard"]
    if type(standard.zeros).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported in compiled mode although no CUDA device is present; "
                    "tests/conftest.py sets TRITON_INTERPRET=1 unless it is already set")


def make_batch(lens, *, last_q, hq, hk, d, dtype=torch.float32, seed=0, spread=1.0):
    """Random packed q (the last min(last_q, len) queries of each sequence) and k."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [min(last_q, n) for n in lens]
    k = torch.randn(sum(lens), hk, d, generator=gen) * spread
    q = torch.randn(sum(q_lens), hq, d, generator=gen) * spread
    return (
        q.to(DEVICE, dtype),
        k.to(DEVICE, dtype),
        cumsum0(q_lens),
        cumsum0(lens),
        max(lens),
    )


def cumsum0(values, dtype=torch.int32):
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return torch.tensor(out, dtype=dtype, device=DEVICE)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def brute_force_block_scores(q, k, lens, last_q, block_size, scale):
    """The definition, literally: one query row at a time, float64, full softmax."""
    group = q.shape[1] // k.shape[1]
    out, q0, k0 = [], 0, 0
    for n in lens:
        n_q = min(last_q, n)
        q_i, k_i = q[q0 : q0 + n_q].double().cpu(), k[k0 : k0 + n].double().cpu()
        q0, k0 = q0 + n_q, k0 + n
        token = torch.zeros(n, dtype=torch.float64)
        for h in range(q.shape[1]):
            for j in range(n_q):
                visible = n - n_q + j + 1
                logits = k_i[:visible, h // group] @ q_i[j, h] * scale
                weights = torch.exp(logits - logits.max())
                token[:visible] += weights / weights.sum() / n_q
        out += [token[b : b + block_size].mean() for b in range(0, n, block_size)]
    return torch.stack(out)


# (id, lengths, last_q, Hq, Hk, head_dim, block_size)
SCORE_CASES = [
    ("ragged-mha", [37, 1, 100, 64], 8, 4, 4, 32, 16),
    ("ragged-gqa2", [70, 5, 33], 16, 4, 2, 32, 16),
    ("ragged-gqa4", [129, 2, 48, 17], 8, 8, 2, 16, 8),
    ("one-token-seqs", [1, 1, 1], 4, 4, 1, 16, 4),
    ("short-than-window", [3, 6, 40], 8, 2, 1, 64, 16),
    ("single-long", [300], 32, 4, 1, 48, 64),
    ("block-size-1", [19, 7], 4, 2, 2, 16, 1),
    ("gemma3-head-dim-256", [90, 33], 8, 4, 1, 256, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_triton_scores_match_reference(case, dtype):
    _, lens, last_q, hq, hk, d, block = case
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=last_q, hq=hq, hk=hk, d=d, dtype=dtype, seed=len(lens))
    ref, ref_cu = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=d**-0.5, impl="torch")
    out, out_cu = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=d**-0.5, impl="triton")
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out_cu, ref_cu)
    assert ref_cu.tolist() == cumsum0([math.ceil(n / block) for n in lens]).tolist()
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("rows_first", [True, False], ids=["rows-first", "chunks-first"])
@pytest.mark.parametrize("case", SCORE_CASES[:3], ids=[c[0] for c in SCORE_CASES[:3]])
def test_triton_scores_with_small_tiles(case, rows_first):
    """Tiles smaller than the sequences: several key chunks, row blocks and block tiles,
    in both pass-1 grid orders."""
    from uniprefill.kernels.score_blocks.kernel import ScoreTiles, score_blocks_fwd

    _, lens, last_q, hq, hk, d, block = case
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=last_q, hq=hq, hk=hk, d=d, seed=3)
    layout = read_layout(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0], max_seqlen_k=max_len,
                         host_cu_seqlens=None)
    tiles = ScoreTiles(stats_block_m=32, stats_block_n=32, stats_warps=4, tokens_block_m=32, tokens_block_n=32,
                       tokens_warps=4, chunk=32, stats_rows_first=rows_first)
    out, _ = score_blocks_fwd(q, k, cu_q, cu_k, layout, block_size=block, scale=d**-0.5, tiles=tiles)
    ref, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=d**-0.5, impl="torch")
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_default_tiles_shrink_for_wide_heads():
    """Heads wider than 128 (Gemma-3: 256) get smaller row/key tiles; the shared-memory tiles
    of the defaults overflowed an H200 SM at head_dim 256 (Triton OutOfResources), and the
    bf16 tiles of head_dim 256 overflowed it again in float32 (256 KiB asked, 227 allowed)."""
    from uniprefill.kernels.score_blocks.kernel import ScoreTiles

    assert ScoreTiles.for_head_dim(64) == ScoreTiles() == ScoreTiles.for_head_dim(128)
    assert ScoreTiles.for_head_dim(128, 4) == ScoreTiles()  # float32 at 128 ran on the H200
    wide = ScoreTiles.for_head_dim(256)
    assert wide.stats_block_m < ScoreTiles().stats_block_m and wide.tokens_block_n < ScoreTiles().tokens_block_n
    wide_fp32 = ScoreTiles.for_head_dim(256, 4)
    assert wide_fp32.stats_block_m < wide.stats_block_m and wide_fp32.tokens_block_m < wide.tokens_block_m

    def shared_bytes(t: ScoreTiles, d: int, size: int) -> tuple[int, int]:
        """Bytes of the tiles a pass keeps in shared memory, counting every operand as
        pipelined (what Triton asked for in the float32 overflow: 2 stages x (64 + 64) x 256 x 4)."""
        stats = t.stats_stages * (t.stats_block_m + t.stats_block_n) * d * size
        tokens = t.tokens_stages * (t.tokens_block_m + t.tokens_block_n) * d * size
        return stats, tokens

    assert shared_bytes(ScoreTiles.for_head_dim(256, 2), 256, 4)[0] == 262144  # the overflow seen
    budget = 200 * 1024  # under an H200 SM's 227 KiB
    for d, size in ((256, 2), (256, 4), (512, 2)):
        assert max(shared_bytes(ScoreTiles.for_head_dim(d, size), d, size)) <= budget, (d, size)


@pytest.mark.parametrize("case", SCORE_CASES[:4], ids=[c[0] for c in SCORE_CASES[:4]])
def test_reference_matches_brute_force(case):
    _, lens, last_q, hq, hk, d, block = case
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=last_q, hq=hq, hk=hk, d=d, seed=7, spread=1.5)
    ref, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=d**-0.5, impl="torch")
    brute = brute_force_block_scores(q, k, lens, last_q, block, d**-0.5)
    assert rel_err(ref.cpu(), brute) < 1e-5


def test_token_scores_sum_to_head_count():
    lens, hq, block = [50, 9], 4, 8
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=8, hq=hq, hk=2, d=16)
    scores, cu_blocks = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=0.25, impl="triton")
    counts = torch.cat([score_reference.block_token_counts(n, block, DEVICE) for n in lens])
    per_seq = [(scores * counts)[a:b].sum().item() for a, b in zip(cu_blocks.tolist(), cu_blocks.tolist()[1:])]
    assert per_seq == pytest.approx([hq] * len(lens), rel=1e-5)


def test_strided_views_of_sdpa_layout():
    """The caller passes transposed views of [1, H, N, d] tensors."""
    n, hq, hk, d, last_q = 90, 4, 2, 32, 16
    gen = torch.Generator().manual_seed(11)
    q_full = torch.randn(1, hq, n, d, generator=gen).to(DEVICE)
    k_full = torch.randn(1, hk, n, d, generator=gen).to(DEVICE)
    q = q_full[0, :, -last_q:].transpose(0, 1)
    k = k_full[0].transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    cu_q, cu_k = cumsum0([last_q]), cumsum0([n])
    out, _ = api.score_blocks(q, k, cu_q, cu_k, n, block_size=16, scale=d**-0.5, impl="triton")
    ref, _ = api.score_blocks(q.contiguous(), k.contiguous(), cu_q, cu_k, n, block_size=16, scale=d**-0.5,
                              impl="torch")
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_scores_are_deterministic():
    q, k, cu_q, cu_k, max_len = make_batch([200, 31], last_q=16, hq=4, hk=2, d=32, dtype=torch.bfloat16)
    runs = [api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=16, scale=0.2, impl="triton")[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_host_cu_seqlens_skip_the_read_and_give_the_same_scores():
    lens = [40, 12]
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=8, hq=2, hk=1, d=16)
    host = (cu_q.tolist(), cu_k.tolist())
    a, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=8, scale=0.25, impl="triton")
    b, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=8, scale=0.25, impl="triton", host_cu_seqlens=host)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="host_cu_seqlens"):
        api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=8, scale=0.25, host_cu_seqlens=([0, 8], host[1]))


# --------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------
def integer_scores(cu_blocks, seed):
    """Positive integer-valued float32 scores: every prefix sum is exact in float32 in any
    order, so Triton's tree cumsum and torch's sequential one agree bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (cu_blocks[-1],), generator=gen).float().to(DEVICE)


SELECT_CASES = [
    # (id, lengths, block_size, sink, last_q, min_tokens)
    ("ragged", [1000, 5, 64, 257, 130], 16, 4, 8, 0),
    ("empty-after-sink", [24, 25, 40], 8, 16, 8, 0),
    ("min-tokens", [300, 600], 32, 0, 32, 400),
    ("no-sink", [513, 77], 64, 0, 1, 0),
    ("one-token", [1, 1, 900], 16, 1, 1, 0),
]


@pytest.mark.parametrize("selection", ["paper", "content"])
@pytest.mark.parametrize("keep_ratio", [None, 0.3], ids=lambda r: f"ratio={r}")
@pytest.mark.parametrize("p", [0.3, 0.95, 1.0], ids=lambda p: f"p={p}")
@pytest.mark.parametrize("case", SELECT_CASES, ids=[c[0] for c in SELECT_CASES])
def test_triton_selection_matches_reference(case, p, keep_ratio, selection):
    _, lens, block, sink, last_q, min_tokens = case
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    scores = integer_scores(cu_blocks.tolist(), seed=len(lens) + block)
    rule = SelectionRule(p=p, keep_ratio=keep_ratio, block_size=block, sink=sink, last_q=last_q,
                         min_tokens=min_tokens, selection=selection)
    ref = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="torch")
    out = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="triton", max_seqlen_k=max(lens))
    assert out.dtype == torch.bool and torch.equal(out, ref)
    check_selection(scores, out, cu_blocks, lens, rule)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", SELECT_CASES[:4], ids=[c[0] for c in SELECT_CASES[:4]])
def test_one_p_per_sequence_equals_each_sequence_with_its_own_p(case, impl):
    """A serving engine's per-request p: a host tensor [B] selects, for every sequence, exactly
    what a call with that sequence's p alone selects (p = 1 keeps all of its blocks)."""
    _, lens, block, sink, last_q, min_tokens = case
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    scores = integer_scores(cu_blocks.tolist(), seed=3 * len(lens) + block)
    ps = [0.3, 1.0, 0.8, 0.95, 0.5][: len(lens)]
    settings = dict(keep_ratio=None, block_size=block, sink=sink, last_q=last_q, min_tokens=min_tokens)
    rule = SelectionRule(p=torch.tensor(ps), **settings)
    out = api.select_blocks(scores, cu_blocks, cu_k, rule, impl=impl, max_seqlen_k=max(lens))
    bounds = cu_blocks.tolist()
    for b, p in enumerate(ps):
        alone = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=p, **settings), impl=impl,
                                  max_seqlen_k=max(lens))
        assert torch.equal(out[bounds[b]:bounds[b + 1]], alone[bounds[b]:bounds[b + 1]]), f"sequence {b}, p = {p}"
    forced = {**settings, "keep_ratio": 0.3}
    ratio = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=torch.tensor(ps), **forced), impl=impl)
    assert torch.equal(ratio, api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=0.9, **forced),
                                                impl=impl))  # a keep ratio ignores p


def test_per_sequence_p_is_checked():
    cu_k, cu_blocks = cumsum0([64, 64]), cumsum0([4, 4])
    scores = torch.ones(8, device=DEVICE)
    settings = dict(keep_ratio=None, block_size=16, sink=0, last_q=1, min_tokens=0)
    for bad, message in ((torch.tensor([0.5]), r"\[B\] = \[2\]"), (torch.tensor([0.5, 0.0]), r"in \(0, 1\]"),
                         (torch.tensor([0.5, 0.9], dtype=torch.float64), "float32")):
        with pytest.raises(ValueError, match=message):  # the values when the rule is built, the length at the call
            api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=bad, **settings))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("rule_kind", ["p=0.8", "p-per-sequence", "ratio=0.3", "content"])
@pytest.mark.parametrize("case", SELECT_CASES[:4], ids=[c[0] for c in SELECT_CASES[:4]])
def test_one_sink_per_sequence_equals_each_sequence_with_its_own_sink(case, rule_kind, impl):
    """A serving engine's step mixes whole prompts (the config's sink) with last chunks whose context holds
    some or all of the sink tokens: a host tensor [B] of sink counts selects, for every sequence, exactly what
    a call with that sequence's sink alone selects, its own shortest length (sink + last_q) included; with one
    p, a p per sequence, or a forced keep ratio."""
    _, lens, block, _, last_q, min_tokens = case
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    scores = integer_scores(cu_blocks.tolist(), seed=5 * len(lens) + block)
    sinks = [2 * block, 0, 1, 3 * block, 0][: len(lens)]
    ps = [0.8, 0.5, 0.95, 0.3, 0.9][: len(lens)]
    p = torch.tensor(ps) if rule_kind == "p-per-sequence" else 0.8
    ratio = 0.3 if rule_kind == "ratio=0.3" else None
    selection = "content" if rule_kind == "content" else "paper"
    settings = dict(keep_ratio=ratio, block_size=block, last_q=last_q, min_tokens=min_tokens, selection=selection)
    out = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=p, sink=torch.tensor(sinks), **settings),
                            impl=impl, max_seqlen_k=max(lens))
    bounds = cu_blocks.tolist()
    for b, sink in enumerate(sinks):
        own_p = ps[b] if rule_kind == "p-per-sequence" else 0.8
        alone = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(p=own_p, sink=sink, **settings),
                                  impl=impl, max_seqlen_k=max(lens))
        assert torch.equal(out[bounds[b]:bounds[b + 1]], alone[bounds[b]:bounds[b + 1]]), f"sequence {b}, sink {sink}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_per_sequence_sink_forces_that_sequences_first_blocks_only(impl):
    """Two equal sequences (the same scores), sinks 0 and 160 at p = 0.3: only the second keeps its first ten
    blocks whatever their scores, and the first equals a call with no sink."""
    lens, block = [1000, 1000], 16
    cu_k, cu_blocks = cumsum0(lens), cumsum0([63, 63])
    one = integer_scores([0, 63], seed=11)
    scores = torch.cat([one, one])
    settings = dict(p=0.3, keep_ratio=None, block_size=block, last_q=8, min_tokens=0)
    out = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=torch.tensor([0, 160]), **settings),
                            impl=impl, max_seqlen_k=1000).cpu()
    alone = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=0, **settings), impl=impl,
                              max_seqlen_k=1000).cpu()
    assert out[63:73].all() and not out[:10].all()
    assert torch.equal(out[:63], alone[:63])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_per_sequence_sinks_beyond_int32_and_strided_views(impl):
    """A sink beyond int32 forces its whole sequence (the Triton wrapper caps the counts at 2**30 before its int32
    copy: a sequence that long does not exist), and a strided view of sink counts reads as its values."""
    lens, block = [200, 200, 200], 16
    cu_k, cu_blocks = cumsum0(lens), cumsum0([13, 13, 13])
    scores = integer_scores(cu_blocks.tolist(), seed=7)
    settings = dict(p=0.3, keep_ratio=None, block_size=block, last_q=8, min_tokens=0)
    huge = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=torch.tensor([0, 2**32, 16]), **settings),
                             impl=impl, max_seqlen_k=200).cpu()
    assert huge[13:26].all() and not huge[:13].all()
    strided = torch.tensor([0, 99, 160, 99, 16, 99], dtype=torch.int32)[::2]
    view = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=strided, **settings), impl=impl,
                             max_seqlen_k=200)
    dense = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=torch.tensor([0, 160, 16]), **settings),
                              impl=impl, max_seqlen_k=200)
    assert torch.equal(view, dense) and not torch.equal(view.cpu(), huge)


def test_per_sequence_sink_is_checked():
    cu_k, cu_blocks = cumsum0([64, 64]), cumsum0([4, 4])
    scores = torch.ones(8, device=DEVICE)
    settings = dict(p=0.9, keep_ratio=None, block_size=16, last_q=1, min_tokens=0)
    for bad, message in ((torch.tensor([4]), r"\[B\] = \[2\]"), (torch.tensor([4, -1]), ">= 0"),
                         (torch.tensor([4.0, 1.0]), "int32 / int64"), (torch.tensor([[4, 1]]), "int32 / int64")):
        with pytest.raises(ValueError, match=message):  # the values when the rule is built, the length at the call
            api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(sink=bad, **settings))
    with pytest.raises(ValueError, match="sequence_min_tokens"):
        SelectionRule(sink=torch.tensor([4, 1]), **settings).effective_min_tokens


def check_selection(scores, keep, cu_blocks, lens, rule):
    """The properties of a selection, sequence by sequence (`rule` with one number as p)."""
    p, keep_ratio, block_size, sink, last_q = rule.p, rule.keep_ratio, rule.block_size, rule.sink, rule.last_q
    bounds = cu_blocks.tolist()
    for b, n in enumerate(lens):
        s, kept = scores[bounds[b] : bounds[b + 1]].double().cpu(), keep[bounds[b] : bounds[b + 1]].cpu()
        forced = select_reference.forced_blocks(n, block_size, sink, last_q, "cpu")
        if n < rule.effective_min_tokens or (keep_ratio is None and p >= 1):
            assert kept.all()
            continue
        assert kept[forced].all(), "sink and window blocks are always kept"
        optional = kept & ~forced
        if keep_ratio is None:
            if rule.selection == "content":  # p of the free blocks' score, from free blocks alone
                s = s.masked_fill(forced, 0.0)
            assert s[kept].sum() >= p * s.sum() * (1 - 1e-6)
            if optional.any():  # minimal: without its weakest optional block it falls short
                assert s[kept].sum() - s[optional].min() < p * s.sum()
        else:
            tokens = score_reference.block_token_counts(n, block_size, "cpu")
            target = math.ceil(keep_ratio * n)
            assert tokens[kept].sum() >= target
            if optional.any():
                weakest = torch.where(optional, s, math.inf).argmin()
                assert tokens[kept].sum() - tokens[weakest] < target


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_selection_of_real_scores_has_its_properties(impl):
    lens, last_q, block = [700, 260, 90, 3], 16, 16
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=last_q, hq=4, hk=2, d=32, seed=5, spread=2.0)
    scores, cu_blocks = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=block, scale=32**-0.5, impl=impl)
    for p, ratio in [(0.5, None), (0.95, None), (1.0, None), (0.9, 0.3)]:
        rule = SelectionRule(p=p, keep_ratio=ratio, block_size=block, sink=16, last_q=last_q, min_tokens=0)
        keep = api.select_blocks(scores, cu_blocks, cu_k, rule, impl=impl)
        check_selection(scores, keep, cu_blocks, lens, rule)
        if p == 1.0:
            assert keep.all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_content_selection_counts_only_the_free_blocks(impl):
    """Sink and window hold 95% of the score: the paper's rule at p = 0.9 keeps them alone;
    "content" keeps the free blocks holding 90% of the other 5%."""
    n, block = 16 * 10, 16  # blocks 0 (sink) and 9 (window) are forced
    free = [8.0, 1.0, 4.0, 2.0, 16.0, 1.0, 0.5, 0.5]  # sums to 33
    scores = torch.tensor([313.5] + free + [313.5], device=DEVICE)  # forced: 627 of 660 (95%)
    cu_k, cu_blocks = cumsum0([n]), cumsum0([10])
    settings = dict(p=0.9, keep_ratio=None, block_size=block, sink=1, last_q=1, min_tokens=0)
    paper = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(**settings), impl=impl)
    assert paper.tolist() == [True] + [False] * 8 + [True]
    content = api.select_blocks(scores, cu_blocks, cu_k, SelectionRule(selection="content", **settings), impl=impl)
    # 16 + 8 + 4 = 28 < 29.7 = 0.9 * 33; + 2 = 30 reaches it
    assert content.tolist() == [True, True, False, True, True, True, False, False, False, True]
    with pytest.raises(ValueError, match="selection='cheap' is not one of"):
        SelectionRule(selection="cheap", **settings)


def test_selection_ties_go_to_the_lower_block():
    cu_k, cu_blocks = cumsum0([10 * 8]), cumsum0([10])
    scores = torch.tensor([5, 1, 3, 3, 3, 3, 0.5, 0.5, 0.5, 9], dtype=torch.float32, device=DEVICE)
    # forced: block 0 (sink) and block 9 (window); total 29, target 0.6 * 29 = 17.4:
    # 5 + 9 = 14, then the first 3 (block 2) reaches 17.
    rule = SelectionRule(p=0.6, keep_ratio=None, block_size=8, sink=1, last_q=1, min_tokens=0)
    for impl in ("torch", "triton"):
        keep = api.select_blocks(scores, cu_blocks, cu_k, rule, impl=impl)
        assert keep.nonzero().flatten().tolist() == [0, 2, 3, 9], impl


@pytest.mark.parametrize("n_blocks", [1024, 4096, MAX_BLOCKS_PER_SEQUENCE])
def test_selection_up_to_the_limit(n_blocks):
    if DEVICE.type == "cpu" and n_blocks > 1024:
        pytest.skip("larger sorts take minutes in the interpreter; checked on the GPU")
    cu_k, cu_blocks = cumsum0([n_blocks * 64]), cumsum0([n_blocks])
    scores = integer_scores(cu_blocks.tolist(), seed=1)
    rule = SelectionRule(p=0.8, keep_ratio=None, block_size=64, sink=128, last_q=128, min_tokens=0)
    ref = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="torch")
    out = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="triton")
    assert torch.equal(out, ref)


def test_selection_above_the_limit_names_it():
    n_blocks = MAX_BLOCKS_PER_SEQUENCE + 1
    cu_k, cu_blocks = cumsum0([n_blocks]), cumsum0([n_blocks])
    scores = torch.ones(n_blocks, device=DEVICE)
    with pytest.raises(ValueError, match=f"{MAX_BLOCKS_PER_SEQUENCE}.*impl='torch'"):
        api.select_blocks(scores, cu_blocks, cu_k,
                          SelectionRule(p=0.9, keep_ratio=None, block_size=1, sink=0, last_q=1, min_tokens=0),
                          impl="triton")


def test_selection_is_deterministic():
    cu_k, cu_blocks = cumsum0([3000, 1000]), cumsum0([188, 63])
    scores = torch.rand(251, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rule = SelectionRule(p=0.9, keep_ratio=None, block_size=16, sink=4, last_q=8, min_tokens=0)
    a = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="triton")
    b = api.select_blocks(scores, cu_blocks, cu_k, rule, impl="triton")
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("lens,block", [([50, 0, 17, 64, 1], 16), ([2500, 3, 1100], 1)], ids=["ragged", "long"])
def test_compaction_indices_and_offsets(lens, block, impl):
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    keep = torch.rand(cu_blocks[-1].item(), generator=torch.Generator().manual_seed(4)) < 0.5
    keep = keep.to(DEVICE)
    kept_idx, cu_kept, counts = api.compact_tokens(keep, cu_blocks, cu_k, block, impl=impl)

    token_keep, expected_counts = [], []
    for b, n in enumerate(lens):
        blocks = keep[cu_blocks[b] : cu_blocks[b + 1]].cpu()
        mask = [bool(blocks[t // block]) for t in range(n)]
        token_keep += mask
        expected_counts.append(sum(mask))
    expected = [i for i, kept in enumerate(token_keep) if kept]
    assert kept_idx.dtype == torch.int64 and kept_idx.tolist() == expected
    assert counts == expected_counts
    assert cu_kept.dtype == torch.int32 and cu_kept.device == keep.device
    assert cu_kept.tolist() == cumsum0(expected_counts).tolist()


def test_compaction_syncs_exactly_once(monkeypatch):
    """PyTorch path, counted here; the Triton path is counted on the GPU (the interpreter
    itself copies kernel arguments to the host)."""
    lens, block = [40, 9, 33], 8
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    keep = (torch.arange(cu_blocks[-1].item()) % 3 != 1).to(DEVICE)
    calls = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    kept_idx, cu_kept, counts = api.compact_tokens(keep, cu_blocks, cu_k, block, impl="torch")
    monkeypatch.undo()
    assert calls == ["tolist"]
    assert sum(counts) == kept_idx.shape[0]


def test_score_and_select_end_to_end():
    lens, last_q, block = [400, 100, 7], 16, 16
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=last_q, hq=4, hk=2, d=32, seed=9, spread=2.0)
    rule = SelectionRule(block_size=block, p=0.9, keep_ratio=None, sink=8, last_q=last_q, min_tokens=0)
    sel = {impl: api.score_and_select(q, k, cu_q, cu_k, max_len, rule, scale=32**-0.5, impl=impl)
           for impl in ("torch", "triton")}
    assert rel_err(sel["triton"].block_scores, sel["torch"].block_scores) < TOLERANCE[torch.float32]
    assert torch.equal(sel["triton"].block_keep, sel["torch"].block_keep)
    assert torch.equal(sel["triton"].kept_idx, sel["torch"].kept_idx)
    assert sel["triton"].kept_counts == sel["torch"].kept_counts
    # sink and window tokens survive
    kept = set(sel["triton"].kept_idx.tolist())
    for start, n in zip(cu_k.tolist(), lens):
        assert set(range(start, start + min(8, n))) <= kept
        assert set(range(start + n - min(last_q, n), start + n)) <= kept


# --------------------------------------------------------------------------------------
# Implementation choice and input validation
# --------------------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter is the CPU path")
def test_the_interpreter_really_runs_on_cpu():
    from uniprefill.kernels.score_blocks import kernel as score_blocks
    from uniprefill.kernels.select_blocks import kernel as select_blocks

    q, k, cu_q, cu_k, max_len = make_batch([20], last_q=4, hq=2, hk=1, d=16)
    scores, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=4, scale=0.25, impl="triton")
    assert scores.device.type == "cpu"
    for kernel in (score_blocks._softmax_stats_kernel, select_blocks._select_blocks_kernel):
        assert type(kernel).__name__ == "InterpretedFunction"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the CPU refusal")
def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, cu_q, cu_k, max_len = make_batch([20], last_q=4, hq=2, hk=1, d=16)
    with pytest.raises(ValueError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=4, scale=0.25, impl="triton")
    scores, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=4, scale=0.25)  # auto: torch
    assert scores.shape == (5,)


def _bad_inputs():
    q, k, cu_q, cu_k, n = make_batch([20, 10], last_q=4, hq=4, hk=2, d=16)
    yield "q not 3-D", dict(q=q[0]), "q must be a 3-D tensor"
    yield "int dtype", dict(q=q.int(), k=k.int()), "q.dtype must be one of"
    yield "mixed dtypes", dict(k=k.half()), "share a dtype"
    yield "head_dim", dict(k=k[..., :8]), "share head_dim"
    yield "gqa", dict(k=torch.cat([k, k[:, :1]], 1)), "multiple of k heads.*Hq=4 and Hk=3"
    yield "cu length", dict(cu_seqlens_k=cu_k[:2]), "cu_seqlens_k must have 3 entries"
    yield "cu dtype", dict(cu_seqlens_q=cu_q.float()), "cu_seqlens_q.dtype"
    yield "not monotonic", dict(cu_seqlens_k=torch.tensor([0, 31, 30], dtype=torch.int32, device=DEVICE)), "non-decreasing"
    yield "wrong total", dict(cu_seqlens_k=torch.tensor([0, 20, 29], dtype=torch.int32, device=DEVICE)), "end at 30"
    yield "too many queries", dict(cu_seqlens_q=torch.tensor([0, 0, 8], dtype=torch.int32, device=DEVICE)), "1 <= queries <= keys"
    yield "max_seqlen_k", dict(max_seqlen_k=19), "max_seqlen_k=19 is below"
    yield "block_size", dict(block_size=0), "block_size=0 must be >= 1"
    yield "scale", dict(scale=-0.1), "scale must be a positive finite number, got -0.1"
    yield "impl", dict(impl="cuda"), "impl='cuda' is not one of"


@pytest.mark.parametrize("name,override,message", list(_bad_inputs()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_value_error(name, override, message):
    q, k, cu_q, cu_k, n = make_batch([20, 10], last_q=4, hq=4, hk=2, d=16)
    args = dict(q=q, k=k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=n, block_size=4, scale=0.25)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        api.score_blocks(**args)


def test_bad_selection_inputs_raise_value_error():
    cu_k, cu_blocks = cumsum0([20]), cumsum0([5])
    good = dict(p=0.9, keep_ratio=None, block_size=4, sink=0, last_q=1, min_tokens=0)
    with pytest.raises(ValueError, match="block_scores.dtype must be torch.float32"):
        api.select_blocks(torch.ones(5, dtype=torch.float16, device=DEVICE), cu_blocks, cu_k, SelectionRule(**good))
    with pytest.raises(ValueError, match=r"p=1.5 must be a number in \(0, 1\]"):
        SelectionRule(**{**good, "p": 1.5})
    with pytest.raises(ValueError, match="keep_ratio=0 must be None"):
        SelectionRule(**{**good, "keep_ratio": 0})
    with pytest.raises(ValueError, match="rule must be a SelectionRule, got dict"):
        api.select_blocks(torch.ones(5, device=DEVICE), cu_blocks, cu_k, good)
    with pytest.raises(ValueError, match="block_keep.dtype must be torch.bool"):
        api.compact_tokens(torch.ones(5, device=DEVICE), cu_blocks, cu_k, 4)


# --------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B shapes, precision, host syncs
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[8192], [3000, 5000, 1, 129]], ids=["8k", "ragged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_llama_shapes_match_reference(lens, dtype):
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=128, hq=32, hk=8, d=128, dtype=dtype, seed=1)
    ref, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=64, scale=128**-0.5, impl="torch")
    out, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=64, scale=128**-0.5, impl="triton")
    again, _ = api.score_blocks(q, k, cu_q, cu_k, max_len, block_size=64, scale=128**-0.5, impl="triton")
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert torch.equal(out, again)


def _sync_warnings(caught):
    return [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gpu_compaction_syncs_once(impl):
    lens, block = [5000, 3000], 64
    cu_k = cumsum0(lens)
    cu_blocks = cumsum0([math.ceil(n / block) for n in lens])
    keep = torch.rand(int(cu_blocks[-1]), device=DEVICE) < 0.3
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            api.compact_tokens(keep, cu_blocks, cu_k, block, impl=impl)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(_sync_warnings(caught)) == 1, _sync_warnings(caught)


@pytest.mark.gpu
def test_gpu_score_and_select_with_host_lengths_syncs_once():
    lens = [6000, 2000]
    q, k, cu_q, cu_k, max_len = make_batch(lens, last_q=128, hq=32, hk=8, d=128, dtype=torch.bfloat16)
    host = (cu_q.tolist(), cu_k.tolist())
    rule = SelectionRule(block_size=64, p=0.95, keep_ratio=None, sink=128, last_q=128, min_tokens=0)
    api.score_and_select(q, k, cu_q, cu_k, max_len, rule, scale=128**-0.5, host_cu_seqlens=host)  # compile first
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sel = api.score_and_select(q, k, cu_q, cu_k, max_len, rule, scale=128**-0.5, host_cu_seqlens=host)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(_sync_warnings(caught)) == 1, _sync_warnings(caught)
    assert sum(sel.kept_counts) == sel.kept_idx.shape[0]
