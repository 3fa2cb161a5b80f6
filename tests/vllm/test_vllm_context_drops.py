"""Requests whose prompt starts in vLLM's KV cache (the last chunk of a chunked prefill, or a prefix-cache
hit: the same thing to the worker, `num_computed_tokens` > 0 at the step that reaches the prompt's end) drop
among that step's tokens, their context whole (`UniPrefillConfig.vllm_context_drops`, on by default).

In the fake vLLM of `tests/vllm/fake_vllm_model.py`: step 1 prefills two prompts in part (earlier chunks)
and one whole; step 2 brings the two chunked prompts to their end and decodes the third; step 3 decodes all.
Reference: each request alone in plain PyTorch, the drop point keeping its whole context plus the rows the
rewritten graph kept (`TinyBackbone.reference`), and decode steps attending over exactly those prompt
tokens at each later layer (`TinyBackbone.decode_reference`).
"""

from __future__ import annotations

import pytest
import torch

from fake_vllm import make_world, step
from fake_vllm_model import BLOCK, VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context, kept_per_request, step_context
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.metadata import SkipReason

PROMPTS = [300, 170, 278]  # request 1 prefills whole in step 1; 0 and 2 in two chunks
FIRST = [200, 170, 128]  # step 1's tokens of each request


@pytest.fixture(scope="module")
def model():
    return TinyBackbone().eval()


def run_chunked(model, config: UniPrefillConfig, drops, windows=None, seed: int = 7, first=FIRST):
    """Steps 1-3 above (`first`: step 1's tokens of each request); returns the runtime, each step's hidden
    states, reasons and kept prompt positions, and the token ids of each request."""
    compiled, state = compile_with_drops(model, config, drops, windows)
    torch.manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (n,)) for n in PROMPTS]
    world = fake_context(PROMPTS)
    if windows:
        world.windows = {world.names[i]: w for i, w in windows.items()}
    world.num_prompt_tokens = torch.tensor(PROMPTS)
    prompt_kept = [[set() for _ in drops] for _ in PROMPTS]  # prompt positions each drop point kept
    steps = []
    computed = [0, 0, 0]
    plan = [list(first), [PROMPTS[0] - first[0], 1, PROMPTS[2] - first[2]], [1, 1, 1]]
    for query_lens in plan:
        WORLD.context = step_context(world, computed, query_lens)
        ids, positions = [], []
        for r, (c, q) in enumerate(zip(computed, query_lens)):
            if c + q > tokens[r].numel():  # a decode step: a new token
                tokens[r] = torch.cat([tokens[r], torch.randint(0, VOCAB, (1,))])
            ids.append(tokens[r][c:c + q])
            positions.append(torch.arange(c, c + q))
        with torch.no_grad():
            hidden = compiled(torch.cat(ids), torch.cat(positions))
        runtime = state["runtime"]
        reasons = [SkipReason(int(x)) for x in runtime.step.reasons]
        for r in range(len(PROMPTS)):
            if computed[r] + query_lens[r] >= PROMPTS[r] > computed[r]:  # the step that ends request r's prompt
                for d, point in enumerate(runtime.step.points):
                    prompt_kept[r][d] = set(range(computed[r])) | {computed[r] + i for i in
                                                                   kept_per_request(point, query_lens)[r]}
        steps.append((hidden, reasons, list(query_lens)))
        computed = [c + q for c, q in zip(computed, query_lens)]
    torch._dynamo.reset()
    return state["runtime"], steps, prompt_kept, tokens


@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
@pytest.mark.parametrize("keep", [0.5, None], ids=["keep-0.5", "p-1"])
def test_the_last_chunk_drops_among_its_own_tokens_and_decode_follows(model, drops, keep):
    """Every request's hidden state at every step equals the reference that keeps its context whole; at
    p = 1 every row is kept (the plain model); with keep 0.5 the last chunks lose rows, their contexts none."""
    options = {"keep_ratio": keep} if keep else {"p": 1.0}
    config = UniPrefillConfig(block_size=BLOCK, last_q=16, sink=16, min_tokens=64, **options)
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, drops)
    (_, first, _), (_, second, _), (_, third, _) = steps
    assert first == [SkipReason.PARTIAL_CHUNK, SkipReason.ELIGIBLE, SkipReason.PARTIAL_CHUNK]
    assert second == [SkipReason.ELIGIBLE, SkipReason.DECODE, SkipReason.ELIGIBLE]
    assert third == [SkipReason.DECODE] * 3
    for r, n in enumerate(PROMPTS):
        last = prompt_kept[r][-1]
        if keep:
            assert len(last) < (FIRST[r] if r != 1 else 0) + 0.6 * (n - (FIRST[r] if r != 1 else 0))
        else:
            assert last == set(range(n))
        assert set(range(FIRST[r] if r != 1 else 0)) <= last  # the context stays whole
    assert len(runtime.store) == 3
    for i in (1, 2):  # step 2: two last chunks and a decode; step 3: decodes
        hidden, _, query_lens = steps[i]
        qsl = torch.tensor([0] + query_lens).cumsum(0)
        for r in range(3):
            length = sum(s[2][r] for s in steps[:i + 1])  # request r's tokens so far
            with torch.no_grad():
                ref = model.decode_reference(tokens[r][:length], PROMPTS[r], prompt_kept[r], drops)
            torch.testing.assert_close(hidden[int(qsl[r + 1]) - 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first, sinks", [([200, 170, 20], [0, 16]), ([20, 170, 200], [16, 0])],
                         ids=["lower-row-complete", "lower-row-lacks"])
def test_a_last_chunk_forces_only_the_sinks_its_context_lacks(model, monkeypatch, first, sinks):
    """The sinks are the prompt's first `sink` tokens: a last chunk whose context holds them all forces
    none, one whose context holds 20 of 32 forces the other 12 (one block of 16: the rule forces whole
    blocks), a prompt prefilled whole forces 32. The step's requests are selected in one call with one sink
    count each (the larger count on the lower or the higher batch row); every hidden state still equals the
    reference (its context whole, the kept rows)."""
    from uniprefill.kernels import api

    calls = []
    score_and_select = api.score_and_select

    def recording(q, k, cu_q, cu_k, max_k, rule, **kwargs):
        calls.append((rule.sink.tolist(), len(cu_k) - 1))
        return score_and_select(q, k, cu_q, cu_k, max_k, rule, **kwargs)

    monkeypatch.setattr(api, "score_and_select", recording)
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=32, min_tokens=64)
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, (1,), first=first)
    assert steps[1][1] == [SkipReason.ELIGIBLE, SkipReason.DECODE, SkipReason.ELIGIBLE]
    # step 1: request 1 whole; step 2: the two last chunks in one call, each with its own sink count
    assert BLOCK == 16 and calls == [([32], 1), (sinks, 2)]
    hidden, _, query_lens = steps[1]
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    for r, sink in zip((0, 2), sinks):
        kept = prompt_kept[r][0]
        assert set(range(first[r])) <= kept and len(kept) < PROMPTS[r]
        assert set(range(first[r], first[r] + sink)) <= kept  # the forced block of the sinks the context lacks
        with torch.no_grad():
            ref = model.decode_reference(tokens[r][:PROMPTS[r]], PROMPTS[r], prompt_kept[r], (1,))
        torch.testing.assert_close(hidden[int(qsl[r + 1]) - 1], ref, atol=1e-5, rtol=1e-5)


def test_with_context_drops_off_the_last_chunk_keeps_every_row(model):
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64,
                              vllm_context_drops=False)
    runtime, steps, prompt_kept, _ = run_chunked(model, config, (1,))
    assert steps[1][1] == [SkipReason.HAS_CONTEXT, SkipReason.DECODE, SkipReason.HAS_CONTEXT]
    assert prompt_kept[0][0] == set(range(PROMPTS[0])) and prompt_kept[2][0] == set(range(PROMPTS[2]))
    assert runtime.store.get("req-0") is None and runtime.store.get("req-1") is not None


def assert_steps_match_the_reference(model, steps, prompt_kept, tokens, drops, windows=None):
    """Steps 2 and 3: every request's hidden states equal it alone in plain PyTorch, each drop point keeping
    `prompt_kept` of its prompt and every decoded token, windows over ORIGINAL positions: in step 2 every row the
    step kept (an early row's window reaches into the context), in step 3 the decoded token."""
    for i in (1, 2):
        hidden, _, query_lens = steps[i]  # one row per scheduled token: a dropped row's is not compared
        qsl = torch.tensor([0] + query_lens).cumsum(0)
        for r in range(3):
            done = sum(s[2][r] for s in steps[:i])  # request r's tokens before step i
            length = done + query_lens[r]
            own = sorted(p - done for p in prompt_kept[r][-1] if p >= done) if done < PROMPTS[r] else [0]
            with torch.no_grad():
                ref = model.decode_reference(tokens[r][:length], PROMPTS[r], prompt_kept[r], drops, windows,
                                             rows_from=done)
            torch.testing.assert_close(hidden[int(qsl[r]) + torch.tensor(own)], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {i}, request {r}: {m}")


@pytest.mark.parametrize("drops, windows", [((1,), {0: 24, 2: 24}), ((1, 2), {0: 24, 3: 8}), ((1,), {2: 40, 3: 24})],
                         ids=["one-drop", "two-drops", "two-windows"])
def test_sliding_layers_after_a_drop_see_the_context_of_a_dropping_last_chunk(model, drops, windows):
    """The last chunks drop; a sliding layer after the drop sees, within its window, the context (its last
    entries copied below the kept rows, `window.copy_context_tail`) and the kept rows, and decode after it the
    same plus the decoded tokens. Fails without the copy (the window would read the gap's stale entries) and
    without the context term of `window_counts`."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, drops, windows)
    assert steps[1][1] == [SkipReason.ELIGIBLE, SkipReason.DECODE, SkipReason.ELIGIBLE]
    for r in (0, 2):
        assert len(prompt_kept[r][-1]) < PROMPTS[r] - 30  # the last chunk dropped rows
        assert set(range(FIRST[r])) <= prompt_kept[r][-1]  # its context stayed whole
    assert_steps_match_the_reference(model, steps, prompt_kept, tokens, drops, windows)


def test_sliding_layers_of_one_window_in_two_groups_share_the_copy_positions(model, monkeypatch):
    """Layers 2 and 3 (window 24) are in KV-cache groups 0 and 1: the context tail's positions are built once per
    drop point and window (`window.context_tail_positions`, a host build and a copy), each group's slots from them
    through its own block table, and every step still equals the reference (the copy landed in both groups)."""
    import uniprefill.vllm.window as window

    built = []
    real = window.context_tail_positions
    monkeypatch.setattr(window, "context_tail_positions", lambda *a, **k: built.append(a[2]) or real(*a, **k))
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    drops, windows = (1,), {2: 24, 3: 24}
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, drops, windows)
    assert built == [24]  # the one step with last chunks that drop copies their tails: one build for both layers
    assert_steps_match_the_reference(model, steps, prompt_kept, tokens, drops, windows)


@pytest.mark.parametrize("drops, windows", [((1,), {2: 300}), ((1, 2), {3: 280}), ((1,), {2: 300, 3: 120}),
                                            ((1, 3), {2: 300}), ((0, 2), {1: 300, 3: 300})],
                         ids=["one-drop", "two-drops", "two-windows", "sliding-between-drops",
                              "same-window-before-and-after-a-drop"])
def test_decode_windows_reach_into_the_copied_context(model, drops, windows):
    """Windows longer than the last chunk (first chunks of 60 tokens): prefill rows and decode queries see copied
    context entries, at one or two drop points and in a sliding layer between two drop points. Fails if the drop
    history's window tables leave the context out, or if a later drop point copies nothing (reviewer's mutations),
    or if a later drop point's copy reuses the slots planned for an earlier one (the same group and window, another
    layout)."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, drops, windows, first=[60, 170, 60])
    assert steps[1][1] == [SkipReason.ELIGIBLE, SkipReason.DECODE, SkipReason.ELIGIBLE]
    assert_steps_match_the_reference(model, steps, prompt_kept, tokens, drops, windows)


@pytest.mark.parametrize("drops, windows", [((1,), {2: 24}), ((1,), {3: 24}), ((1, 2), {3: 24}), ((1,), {})],
                         ids=["window-2", "window-3", "two-drops", "no-window"])
def test_a_prefix_hit_on_blocks_written_in_the_same_step(model, drops, windows):
    """vLLM publishes a request's full blocks when it schedules them, so a request scheduled later in the same step
    can hit them: request B's first 48 tokens are request A's blocks (A is short and does not drop), and their KV is
    written by this very forward. The context copy must run after each sliding layer's KV update (the review's
    finding: copied at the drop point, it read stale entries and failed for a window at layer 2 or 3)."""
    ctx, a_len, b_len = 48, 48, 200
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    compiled, state = compile_with_drops(model, config, drops, windows)
    torch.manual_seed(3)
    shared = torch.randint(0, VOCAB, (ctx,))
    tokens_b = torch.cat([shared, torch.randint(0, VOCAB, (b_len,))])
    world = make_world([a_len, ctx + b_len], layers=4, groups=2, block=BLOCK, kv_heads=2, head_size=16, room=8)
    world.windows = {world.names[i]: w for i, w in windows.items()}
    for table in world.tables:  # B's first blocks are A's: a prefix-cache hit
        table[1, :ctx // BLOCK] = table[0, :ctx // BLOCK]
    step(world, [0, ctx], [a_len, b_len])
    world.num_prompt_tokens = torch.tensor([a_len, ctx + b_len])
    WORLD.context = world
    with torch.no_grad():
        hidden = compiled(torch.cat([shared, tokens_b[ctx:]]),
                          torch.cat([torch.arange(a_len), torch.arange(ctx, ctx + b_len)]))
    runtime = state["runtime"]
    assert [SkipReason(int(x)) for x in runtime.step.reasons] == [SkipReason.SHORT, SkipReason.ELIGIBLE]
    kept = [set(range(ctx)) | {ctx + i for i in kept_per_request(p, [a_len, b_len])[1]} for p in runtime.step.points]
    own = sorted(p - ctx for p in kept[-1] if p >= ctx)
    assert len(own) < b_len
    with torch.no_grad():
        ref = model.decode_reference(tokens_b, ctx + b_len, kept, drops, windows or None, rows_from=ctx)
    torch._dynamo.reset()
    torch.testing.assert_close(hidden[a_len + torch.tensor(own)], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drops, windows", [((1,), {2: 200, 3: 200}), ((1, 2), {3: 200}), ((1,), {2: 120, 3: 200})])
def test_decode_graphs_equal_eager_decode_when_decode_sees_the_context(monkeypatch, drops, windows):
    """The device tables of vLLM's full decode graphs count copied context entries as the host path does."""
    import test_vllm_fuzz as fuzz

    monkeypatch.setattr(fuzz, "decode_scenario", lambda seed: (drops, windows, [240, 230, 150], 3, [60, 50, 20]))
    eager, eager_totals = fuzz.run_decode_scenario(900, decode_graphs=False)
    graphed, graph_totals = fuzz.run_decode_scenario(900, decode_graphs=True)
    assert eager_totals.requests_dropped == graph_totals.requests_dropped >= 2
    for want, got in zip(eager, graphed):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_last_chunk_too_short_to_hold_its_context_tail_keeps_every_row(model):
    """A window of 200 needs the context's last 199 (or 128) entries copied below the kept rows; a last chunk of
    78 or 150 rows dropping half leaves a gap of 39 or 75: it keeps every row (`SkipReason.CONTEXT_TAIL`), and the
    whole request 1 (no context) still drops."""
    config = UniPrefillConfig(keep_ratio=0.5, block_size=BLOCK, last_q=16, sink=16, min_tokens=64)
    runtime, steps, prompt_kept, tokens = run_chunked(model, config, (1,), windows={2: 200})
    assert steps[0][1] == [SkipReason.PARTIAL_CHUNK, SkipReason.ELIGIBLE, SkipReason.PARTIAL_CHUNK]
    assert steps[1][1] == [SkipReason.CONTEXT_TAIL, SkipReason.DECODE, SkipReason.CONTEXT_TAIL]
    assert prompt_kept[0][0] == set(range(PROMPTS[0])) and prompt_kept[2][0] == set(range(PROMPTS[2]))
    assert runtime.store.get("req-0") is None and runtime.store.get("req-1") is not None
    assert_steps_match_the_reference(model, steps, prompt_kept, tokens, (1,), {2: 200})


def test_the_option_is_on_by_default_and_enters_the_digest_only_when_off():
    assert UniPrefillConfig().vllm_context_drops is True
    assert UniPrefillConfig().stable_hash() != UniPrefillConfig(vllm_context_drops=False).stable_hash()
    with pytest.raises(ValueError, match="vllm_context_drops"):
        UniPrefillConfig(vllm_context_drops=1)
