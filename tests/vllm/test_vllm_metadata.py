"""vLLM metadata after a drop point (against a brute-force reference with plain Python loops), and the vLLM plugin.

The fakes are shaped like vLLM 0.26's `CommonAttentionMetadata` (flat ragged batches,
int32 `query_start_loc` / `seq_lens` / block tables, int64 slot mappings, host copies) and
built the way vLLM's block allocator fills them: every request owns distinct blocks.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import types

import pytest
import torch
import torch.fx as fx

from uniprefill import UniPrefillConfig
from uniprefill.vllm import plugin as vllm_plugin
from uniprefill.vllm.metadata import (
    DropHistoryStore,
    DropRecord,
    KVCacheGroup,
    RequestDropHistory,
    SkipReason,
    batch_layout,
    compact,
    drop_eligibility,
    layer_sources,
    relayout_kv,
    window_visibility,
)
from uniprefill.vllm.plugin import BACKEND_QUALNAME, VllmTokenDropBackend, check_vllm_config, config_from_compilation_config

ON_CPU = pytest.mark.interpreter  # a case that runs Triton on CPU tensors (tests/conftest.py)


# ----------------------------------------------------------------------------- fakes
@dataclasses.dataclass
class FakeCommonAttentionMetadata:
    """The fields of vLLM's CommonAttentionMetadata that uniprefill changes (same names)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    _seq_lens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None

    def replace(self, **kwargs):
        return dataclasses.replace(self, **kwargs)


@dataclasses.dataclass
class FakeBatch:
    query_lens: list[int]
    ctx: list[int]
    block_sizes: list[int]
    tables: list[torch.Tensor]  # per group [R, max_blocks] int32
    slot_mappings: list[torch.Tensor]  # per group [T] int64, vLLM's formula, padded with -1
    pad: int = 0

    @property
    def qsl(self) -> list[int]:
        out = [0]
        for q in self.query_lens:
            out.append(out[-1] + q)
        return out

    def layout(self, validate="full", impl="auto"):
        qsl = torch.tensor(self.qsl)
        groups = [KVCacheGroup(t, b, s) for t, b, s in zip(self.tables, self.block_sizes, self.slot_mappings)]
        return batch_layout(qsl.to(torch.int32), qsl, torch.tensor([c + q for c, q in zip(self.ctx, self.query_lens)],
                            dtype=torch.int32), torch.tensor(self.ctx), groups, validate=validate, impl=impl)

    def common_metadata(self, group: int = 0) -> FakeCommonAttentionMetadata:
        qsl = torch.tensor(self.qsl, dtype=torch.int32)
        return FakeCommonAttentionMetadata(qsl, qsl.clone(), torch.tensor([c + q for c, q in zip(self.ctx, self.query_lens)],
                                           dtype=torch.int32), len(self.ctx), self.qsl[-1], max(self.query_lens),
                                           max(c + q for c, q in zip(self.ctx, self.query_lens)), self.tables[group],
                                           self.slot_mappings[group])


def make_batch(query_lens, ctx, block_sizes=(16,), seed=0, extra_blocks=2, pad=0) -> FakeBatch:
    rng = random.Random(seed)
    tables, slot_mappings = [], []
    for block in block_sizes:
        need = [(c + q + extra_blocks * block + block - 1) // block for c, q in zip(ctx, query_lens)]
        width = max(need)
        ids = list(range(1, sum(need) + 1))  # block 0 is vLLM's null block
        rng.shuffle(ids)
        table = torch.zeros(len(ctx), width, dtype=torch.int32)
        start = 0
        for r, n in enumerate(need):
            table[r, :n] = torch.tensor(ids[start:start + n], dtype=torch.int32)
            start += n
        slots = []
        for r, (c, q) in enumerate(zip(ctx, query_lens)):
            for i in range(q):
                p = c + i
                slots.append(int(table[r, p // block]) * block + p % block)
        tables.append(table)
        slot_mappings.append(torch.tensor(slots + [-1] * pad, dtype=torch.long))
    return FakeBatch(list(query_lens), list(ctx), list(block_sizes), tables, slot_mappings, pad)


def random_drop(batch: FakeBatch, droppers, seed, keep=0.4):
    """Kept rows: every row of non-droppers; for droppers a random subset that keeps the last token."""
    rng = random.Random(seed)
    kept, counts = [], []
    for r, (start, q) in enumerate(zip(batch.qsl, batch.query_lens)):
        rows = list(range(start, start + q))
        if r in droppers and q > 1:
            body = sorted(rng.sample(rows[:-1], max(0, int(keep * (q - 1)))))
            rows = body + [rows[-1]]
        kept += rows
        counts.append(len(rows))
    return kept, counts


# ----------------------------------------------------------------------------- reference
def reference_compact(batch: FakeBatch, kept: list[int], removed=None):
    """Everything recomputed for the kept tokens with Python loops (vLLM's own formulas)."""
    removed = removed or [0] * len(batch.ctx)
    qsl = batch.qsl
    out = {"qsl": [0], "seq_lens": [], "positions": [], "slots": [[] for _ in batch.block_sizes], "source": []}
    for r, (c, q) in enumerate(zip(batch.ctx, batch.query_lens)):
        mine = [t for t in kept if qsl[r] <= t < qsl[r + 1]]
        for i, t in enumerate(mine):
            logical = c - removed[r] + i
            for g, (table, block) in enumerate(zip(batch.tables, batch.block_sizes)):
                out["slots"][g].append(int(table[r, logical // block]) * block + logical % block)
            out["positions"].append(c + t - qsl[r])
            out["source"].append(t)
        out["qsl"].append(out["qsl"][-1] + len(mine))
        out["seq_lens"].append(c - removed[r] + len(mine))
    out["logits"] = [x - 1 for x in out["qsl"][1:]]
    out["max_query_len"] = max(b - a for a, b in zip(out["qsl"], out["qsl"][1:]))
    out["max_seq_len"] = max(out["seq_lens"])
    return out


def assert_matches(layout, ref):
    assert layout.query_start_loc_cpu.tolist() == ref["qsl"]
    assert layout.query_start_loc.tolist() == ref["qsl"]
    assert layout.query_start_loc.dtype == torch.int32 and layout.seq_lens.dtype == torch.int32
    assert layout.seq_lens.tolist() == ref["seq_lens"] == layout.seq_lens_cpu.tolist()
    assert layout.positions.tolist() == ref["positions"]
    assert layout.source_index.tolist() == ref["source"]
    assert [s.tolist() for s in layout.slot_mappings] == ref["slots"]
    assert layout.logits_indices.tolist() == ref["logits"]
    assert layout.num_actual_tokens == ref["qsl"][-1]
    assert (layout.max_query_len, layout.max_seq_len) == (ref["max_query_len"], ref["max_seq_len"])


# mixed steps: long prefills, decode requests (1 token, prior context), a chunk with context, an empty (padded) request
BATCHES = {
    "prefill-only": ([300, 257, 400], [0, 0, 0], {0, 1, 2}),
    "mixed-decode": ([1, 300, 1, 1, 280], [517, 0, 33, 1024, 0], {1, 4}),
    "chunk-with-context": ([1, 200, 64], [40, 96, 0], {1, 2}),
    "single-token-requests": ([1, 1, 1], [5, 0, 17], set()),
    "empty-request": ([120, 0, 1], [0, 0, 8], {0}),
}


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=ON_CPU)])  # the row kernels (interpreted)
@pytest.mark.parametrize("block_sizes", [(16,), (1,), (64,), (16, 32)], ids=lambda b: "B" + "+".join(map(str, b)))
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_compact_matches_brute_force(name, block_sizes, impl):
    query_lens, ctx, droppers = BATCHES[name]
    batch = make_batch(query_lens, ctx, block_sizes, seed=len(name), pad=5)
    layout = batch.layout(impl=impl)
    kept, counts = random_drop(batch, droppers, seed=1)
    out = compact(layout, torch.tensor(kept), torch.tensor(counts), validate="full")
    assert_matches(out, reference_compact(batch, kept))


def test_requests_not_dropping_pass_through_unchanged():
    batch = make_batch([1, 300, 1, 64], [517, 0, 33, 100], (16, 32), pad=3)
    layout = batch.layout()
    kept, counts = random_drop(batch, {1}, seed=2)
    out = compact(layout, torch.tensor(kept), torch.tensor(counts))
    for r in (0, 2, 3):  # decode, decode, prefix-cached chunk: untouched
        a, b = batch.qsl[r], batch.qsl[r + 1]
        c, d = out.query_start_loc_cpu[r].item(), out.query_start_loc_cpu[r + 1].item()
        for g in range(2):
            assert out.slot_mappings[g][c:d].tolist() == batch.slot_mappings[g][a:b].tolist()
        assert out.positions[c:d].tolist() == layout.positions[a:b].tolist()
        assert out.seq_lens_cpu[r] == layout.seq_lens_cpu[r]


def test_keep_everything_is_identity():
    batch = make_batch([1, 300, 1], [5, 0, 9], (16, 32))
    layout = batch.layout()
    out = compact(layout, torch.arange(layout.num_actual_tokens), layout.query_lens_cpu, validate="full")
    for name in ("query_start_loc_cpu", "seq_lens_cpu", "positions", "source_index"):
        assert torch.equal(getattr(out, name), getattr(layout, name))
    assert all(torch.equal(a, b) for a, b in zip(out.slot_mappings, layout.slot_mappings))


def test_prior_context_slots_never_overwrite_the_context():
    # The released code restarted compacted slots at block 0 (i // B), overwriting cached context.
    batch = make_batch([256], [512], (16,))
    layout = batch.layout()
    kept, counts = random_drop(batch, {0}, seed=3)
    out = compact(layout, torch.tensor(kept), torch.tensor(counts))
    table, block = batch.tables[0], 16
    context_slots = {int(table[0, p // block]) * block + p % block for p in range(512)}
    assert not context_slots & set(out.slot_mappings[0].tolist())
    assert out.slot_mappings[0][0].item() == int(table[0, 512 // block]) * block  # first kept token at index ctx


def test_two_drop_points_compose():
    batch = make_batch([1, 400, 333], [70, 0, 0], (16, 32))
    layout = batch.layout()
    kept1, counts1 = random_drop(batch, {1, 2}, seed=4, keep=0.6)
    first = compact(layout, torch.tensor(kept1), torch.tensor(counts1), validate="full")
    # second drop point: indices relative to the first compacted layout (cumulative policy)
    rng = random.Random(5)
    rel, counts2 = [], []
    qsl1 = first.query_start_loc_cpu.tolist()
    for r in range(3):
        rows = list(range(qsl1[r], qsl1[r + 1]))
        if r in (1, 2):
            rows = sorted(rng.sample(rows[:-1], len(rows) // 2)) + [rows[-1]]
        rel += rows
        counts2.append(len(rows))
    second = compact(first, torch.tensor(rel), torch.tensor(counts2), validate="full")
    absolute = [kept1[i] for i in rel]
    assert_matches(second, reference_compact(batch, absolute))
    assert second.rows_of_source(torch.tensor(absolute)).tolist() == list(range(len(absolute)))
    dropped = sorted(set(range(layout.num_actual_tokens)) - set(absolute))
    assert (second.rows_of_source(torch.tensor(dropped)) == -1).all()


@pytest.mark.parametrize("seed", [s if s % 2 == 0 else pytest.param(s, marks=ON_CPU) for s in range(12)])  # odd: Triton
def test_random_mixed_steps_two_drop_points(seed):
    """Random ragged steps: prefills, decodes with and without history, chunks with context; the row kernels on
    the reference (even seeds) and on Triton (odd seeds, interpreted)."""
    rng = random.Random(seed)
    num_reqs = rng.randint(1, 6)
    query_lens = [rng.choice([1, 1, rng.randint(2, 40), rng.randint(100, 300)]) for _ in range(num_reqs)]
    ctx = [rng.choice([0, rng.randint(1, 200)]) for _ in range(num_reqs)]
    block_sizes = tuple(rng.sample([1, 8, 16, 32], rng.randint(1, 2)))
    batch = make_batch(query_lens, ctx, block_sizes, seed=seed, pad=rng.randint(0, 8))
    layout = batch.layout(impl=("torch", "triton")[seed % 2])
    droppers = {r for r in range(num_reqs) if query_lens[r] > 1 and rng.random() < 0.7}
    removed = [rng.randint(0, c) if query_lens[r] == 1 else 0 for r, c in enumerate(ctx)]
    kept1, counts1 = random_drop(batch, droppers, seed=seed, keep=rng.random())
    first = compact(layout, torch.tensor(kept1, dtype=torch.long), torch.tensor(counts1),
                    kv_removed_cpu=torch.tensor(removed), validate="full")
    assert_matches(first, reference_compact(batch, kept1, removed))
    qsl1 = first.query_start_loc_cpu.tolist()
    rel = []
    for r in range(num_reqs):
        rows = list(range(qsl1[r], qsl1[r + 1]))
        if r in droppers and len(rows) > 1:
            rows = sorted(rng.sample(rows[:-1], rng.randint(0, len(rows) - 1))) + [rows[-1]]
        rel += rows
    counts2 = [sum(1 for i in rel if qsl1[r] <= i < qsl1[r + 1]) for r in range(num_reqs)]
    removed2 = [x + rng.randint(0, c - x) if query_lens[r] == 1 else 0 for r, (x, c) in enumerate(zip(removed, ctx))]
    second = compact(first, torch.tensor(rel, dtype=torch.long), torch.tensor(counts2),
                     kv_removed_cpu=torch.tensor(removed2), validate="full")
    assert_matches(second, reference_compact(batch, [kept1[i] for i in rel], removed2))


def test_history_shift_for_decode_requests():
    # decode requests whose prefill dropped: their layers after the drop hold fewer entries
    batch = make_batch([1, 1, 300], [900, 41, 0], (16, 32))
    layout = batch.layout()
    removed = [600, 0, 0]
    kept, counts = random_drop(batch, {2}, seed=6)
    out = compact(layout, torch.tensor(kept), torch.tensor(counts), kv_removed_cpu=torch.tensor(removed), validate="full")
    assert_matches(out, reference_compact(batch, kept, removed))
    shifted = relayout_kv(layout, torch.tensor(removed))
    assert_matches(shifted, reference_compact(batch, list(range(layout.num_actual_tokens)), removed))


def test_metadata_fields_replace_vllm_shaped_metadata():
    batch = make_batch([1, 300], [12, 0], (16, 32))
    kept, counts = random_drop(batch, {1}, seed=7)
    out = compact(batch.layout(), torch.tensor(kept), torch.tensor(counts))
    for g in range(2):
        meta = batch.common_metadata(g).replace(**out.metadata_fields(g))
        assert meta.num_actual_tokens == len(kept) and meta.slot_mapping is out.slot_mappings[g]
        assert meta.query_start_loc_cpu.dtype == torch.int32
        assert meta.max_seq_len == max(meta.seq_lens.tolist())
        assert meta._seq_lens_cpu.tolist() == meta.seq_lens.tolist()
        query_lens = (meta.query_start_loc_cpu[1:] - meta.query_start_loc_cpu[:-1]).tolist()
        assert meta._num_computed_tokens_cpu.tolist() == [s - q for s, q in zip(meta.seq_lens.tolist(), query_lens)]


def test_no_device_reads_with_shape_validation():
    # Every device-side input on the meta device: any read of device data (a host sync on a
    # GPU) would raise. Host counts are the only values compact may look at.
    batch = make_batch([1, 300, 1], [50, 0, 9], (16, 32))
    qsl = torch.tensor(batch.qsl)
    groups = [KVCacheGroup(t.to("meta"), b, s.to("meta")) for t, b, s in zip(batch.tables, batch.block_sizes,
                                                                              batch.slot_mappings)]
    layout = batch_layout(qsl.to(torch.int32).to("meta"), qsl, torch.empty(3, dtype=torch.int32, device="meta"),
                          torch.tensor(batch.ctx), groups)
    kept, counts = random_drop(batch, {1}, seed=8)
    out = compact(layout, torch.tensor(kept).to("meta"), torch.tensor(counts))
    assert out.positions.device.type == "meta" and out.num_actual_tokens == len(kept)
    store = DropHistoryStore((1,), 3)
    layouts = store.decode_layouts(layout, torch.zeros(3, dtype=torch.long))
    assert layouts[1].slot_mappings[1].device.type == "meta"


# ----------------------------------------------------------------------------- errors
def _args(batch):
    qsl = torch.tensor(batch.qsl)
    groups = [KVCacheGroup(t, b, s) for t, b, s in zip(batch.tables, batch.block_sizes, batch.slot_mappings)]
    seq = torch.tensor([c + q for c, q in zip(batch.ctx, batch.query_lens)], dtype=torch.int32)
    return qsl, groups, seq


@pytest.mark.parametrize("case, match", [
    ("qsl-shape", r"query_start_loc: expected shape \(4,\), got \(3,\)"),
    ("seq-shape", r"seq_lens: expected shape \(3,\), got \(2,\)"),
    ("ctx-device-type", r"num_computed_tokens_cpu: expected a 1-D integer tensor, got 1-D torch.float32"),
    ("slot-short", r"group 0: slot_mapping: expected shape \(302,\)"),
    ("table-rows", r"group 1: block_table: expected shape \(3, max_blocks\), got \(2, "),
    ("block-size", r"block_size must be an integer >= 1, got 0"),
    ("bad-slots", r"group 1: slot_mapping\[0\] = .*, expected .* from block_table"),
    ("bad-seq", r"seq_lens: expected num_computed_tokens \+ query lens = \[8, 300, 20\], got"),
])
def test_batch_layout_rejects_inconsistent_inputs(case, match):
    batch = make_batch([1, 300, 1], [7, 0, 19], (16, 32))
    qsl, groups, seq = _args(batch)
    qsl_dev, ctx = qsl.to(torch.int32), torch.tensor(batch.ctx)
    if case == "qsl-shape":
        qsl_dev = qsl_dev[:3]
    elif case == "seq-shape":
        seq = seq[:2]
    elif case == "ctx-device-type":
        ctx = ctx.float()
    elif case == "slot-short":
        groups[0] = KVCacheGroup(groups[0].block_table, 16, groups[0].slot_mapping[:-1])
    elif case == "table-rows":
        groups[1] = KVCacheGroup(groups[1].block_table[:2], 32, groups[1].slot_mapping)
    elif case == "block-size":
        groups[0] = KVCacheGroup(groups[0].block_table, 0, groups[0].slot_mapping)
    elif case == "bad-slots":
        groups[1] = KVCacheGroup(groups[1].block_table.roll(1, 0), 32, groups[1].slot_mapping)
    elif case == "bad-seq":
        seq = seq + 1
    with pytest.raises(ValueError, match=match):
        batch_layout(qsl_dev, qsl, seq, ctx, groups, validate="full")


@pytest.mark.parametrize("case, match", [
    ("sum", r"kept: expected a 1-D tensor of sum\(kept_counts_cpu\) = \d+ indices, got shape"),
    ("counts-shape", r"kept_counts_cpu: expected shape \(3,\), got \(2,\)"),
    ("too-many", r"kept_counts_cpu\[0\] = 2: expected 1..1"),
    ("decode-dropped", r"kept_counts_cpu\[2\] = 0: expected 1..1"),
    ("device-counts", r"kept_counts_cpu: expected a host \(cpu\) tensor"),
    ("unsorted", r"kept: expected strictly increasing indices"),
    ("wrong-request", r"kept: indices fall per request as \[1, \d+, 0\], expected kept_counts_cpu \[1, \d+, 1\]"),
    ("last-dropped", r"kept: expected every request's last token to be kept; rows \[300\]"),
    ("removed", r"kv_removed_cpu must lie in \[0, num_computed_tokens\]"),
    ("narrow-table", r"group 0: block_table has 1 columns, expected at least \d+ for the longest request"),
])
def test_compact_rejects_inconsistent_inputs(case, match):
    batch = make_batch([1, 300, 1], [7, 0, 19], (16, 32))
    layout = batch.layout()
    kept, counts = random_drop(batch, {1}, seed=9)
    kept_t, counts_t, removed = torch.tensor(kept), torch.tensor(counts), None
    if case == "sum":
        kept_t = kept_t[:-1]
    elif case == "counts-shape":
        counts_t = counts_t[:2]
    elif case == "too-many":
        counts_t = torch.tensor([2, counts[1] - 1, 1])
    elif case == "decode-dropped":
        counts_t = torch.tensor([1, counts[1] + 1, 0])
    elif case == "device-counts":
        counts_t = counts_t.to("meta")
    elif case == "unsorted":
        kept_t = kept_t.flip(0)
    elif case == "wrong-request":  # request 2's only token swapped for an unkept token of request 1
        spare = next(i for i in range(1, 300) if i not in kept)
        kept_t = torch.tensor(sorted(kept[:-1] + [spare]))
    elif case == "last-dropped":  # request 1's last token (row 300) swapped for an unkept one
        spare = next(i for i in range(1, 300) if i not in kept)
        kept_t = torch.tensor(sorted([i for i in kept if i != 300] + [spare]))
    elif case == "removed":
        removed = torch.tensor([8, 0, 0])
    elif case == "narrow-table":
        layout = dataclasses.replace(layout, block_tables=(layout.block_tables[0][:, :1], layout.block_tables[1]))
    with pytest.raises(ValueError, match=match):
        compact(layout, kept_t, counts_t, kv_removed_cpu=removed, validate="full")


# ----------------------------------------------------------------------------- eligibility
def test_drop_eligibility_reasons():
    qlen = torch.tensor([1, 512, 512, 100, 300, 2048, 0])
    ctx = torch.tensor([700, 0, 512, 0, 0, 1024, 5])
    prompt = torch.tensor([700, 1024, 1024, 100, 300, 3072, 5])
    reasons = drop_eligibility(qlen, ctx, prompt, min_tokens=256)
    assert [SkipReason(int(r)) for r in reasons] == [
        SkipReason.DECODE, SkipReason.PARTIAL_CHUNK, SkipReason.HAS_CONTEXT, SkipReason.SHORT,
        SkipReason.ELIGIBLE, SkipReason.HAS_CONTEXT, SkipReason.DECODE]
    assert SkipReason(int(drop_eligibility(qlen, ctx, prompt, 256, allow_context=True)[2])) == SkipReason.ELIGIBLE
    # prompt logprobs / an opt-out keep every row; a decode step stays a decode step
    opted = torch.tensor([True, False, False, False, True, False, False])
    reasons = drop_eligibility(qlen, ctx, prompt, 256, opted_out_cpu=opted)
    assert [SkipReason(int(r)) for r in reasons][:5] == [
        SkipReason.DECODE, SkipReason.PARTIAL_CHUNK, SkipReason.HAS_CONTEXT, SkipReason.SHORT, SkipReason.OPTED_OUT]
    with pytest.raises(ValueError, match="opted_out_cpu"):
        drop_eligibility(qlen, ctx, prompt, 256, opted_out_cpu=opted[:3])


# ----------------------------------------------------------------------------- history
NUM_LAYERS = 8
DROPS = (2, 5)


def make_history(request_id, context, prompt_len, seed, policy="cumulative"):
    rng = random.Random(seed)
    positions = list(range(context, context + prompt_len))
    drops = []
    for layer in DROPS:
        pool = positions if (policy == "suspend" or not drops) else drops[-1].kept_positions.tolist()
        keep = sorted(rng.sample(pool[:-1], len(pool) // 3)) + [pool[-1]]
        drops.append(DropRecord(layer, len(keep), torch.tensor(keep)))
    return RequestDropHistory(request_id, context, prompt_len, tuple(drops), policy)


@pytest.mark.parametrize("policy", ["cumulative", "suspend"])
def test_layer_sources_and_kv_lens(policy):
    sources = layer_sources(DROPS, NUM_LAYERS, policy)
    # layer 2 drops after its own attention: its KV holds everything; layer 3.. hold drop 0's kept tokens
    expected = [-1, -1, -1, 0, 0, -1 if policy == "suspend" else 0, 1, 1]
    assert sources == expected
    h = make_history("a", 0, 400, seed=1, policy=policy)
    assert h.lengths == [(0, 400), (2, h.drops[0].kept_len), (5, h.drops[1].kept_len)]
    for layer in range(NUM_LAYERS):
        assert h.source(layer) == sources[layer]
        for decoded in (0, 1, 7):
            kept = 400 if sources[layer] < 0 else h.drops[sources[layer]].kept_len
            assert h.kv_len(layer, decoded) == kept + decoded == h.key_positions(layer, decoded).numel()


def _store_with(histories, max_window=0, capacity=2, policy="cumulative"):
    store = DropHistoryStore(DROPS, NUM_LAYERS, policy=policy, max_window=max_window, capacity=capacity)
    rows = {h.request_id: store.add(h) for h in histories}
    return store, rows


@pytest.mark.parametrize("policy", ["cumulative", "suspend"])
def test_layer_kv_lens_vectorised_matches_per_request(policy):
    histories = [make_history(f"r{i}", ctx, n, seed=i, policy=policy)
                 for i, (ctx, n) in enumerate([(0, 300), (64, 500), (0, 260), (10, 999)])]
    store, _ = _store_with(histories, capacity=2, policy=policy)  # forces growth
    ids = ["r2", "plain", "r0", "r3", "r1"]
    decoded = [3, 0, 1, 40, 2]
    plain_len = 77
    seq = torch.tensor([(h.prompt_end + d) if (h := store.get(r)) else plain_len for r, d in zip(ids, decoded)])
    lens = store.layer_kv_lens(store.rows_for(ids), seq)
    for i, r in enumerate(ids):
        h = store.get(r)
        for layer in range(NUM_LAYERS):
            assert lens[i, layer] == (h.kv_len(layer, decoded[i]) if h else plain_len)


def test_decode_layouts_match_brute_force():
    # a decode step mixing requests with and without history, two KV groups
    histories = [make_history("a", 0, 300, seed=1), make_history("b", 32, 400, seed=2)]
    store, _ = _store_with(histories)
    ids = ["b", "x", "a"]
    decoded = [5, 0, 2]
    ctx = [432 + 5 - 1, 90, 300 + 2 - 1]  # vLLM counts every token ever written (incl. dropped ones)
    batch = make_batch([1, 1, 1], ctx, (16, 32))
    layouts = store.decode_layouts(batch.layout(), store.rows_for(ids))
    for layer in range(NUM_LAYERS):
        lay = layouts[int(store.layer_column[layer])]
        for r, rid in enumerate(ids):
            h = store.get(rid)
            kv_len = h.kv_len(layer, decoded[r]) if h else ctx[r] + 1
            assert lay.seq_lens_cpu[r] == kv_len
            for g, (table, block) in enumerate(zip(batch.tables, batch.block_sizes)):
                p = kv_len - 1  # the new token is written right after the entries the layer holds
                assert lay.slot_mappings[g][r] == int(table[r, p // block]) * block + p % block
            assert lay.positions[r] == ctx[r]  # RoPE still sees the ORIGINAL position


@pytest.mark.parametrize("policy", ["cumulative", "suspend"])
@pytest.mark.parametrize("window", [1, 16, 64])
def test_window_first_visible_matches_position_rule(window, policy):
    histories = [make_history("a", 0, 300, seed=3, policy=policy), make_history("b", 48, 200, seed=4, policy=policy)]
    store, _ = _store_with(histories, max_window=64, policy=policy)
    cases = [("a", 300), ("a", 301), ("a", 330), ("b", 248), ("b", 260), ("b", 400), ("plain", 10), ("plain", 200)]
    rows = store.rows_for([c[0] for c in cases])
    pos = torch.tensor([c[1] for c in cases])
    for layer in range(NUM_LAYERS):
        first, count = store.window_first_visible(rows, pos, layer, window)
        for i, (rid, p) in enumerate(cases):
            h = store.get(rid)
            keys = h.key_positions(layer, p - h.prompt_end + 1) if h else torch.arange(p + 1)
            visible = window_visibility(torch.tensor([p]), keys, window)[0]
            idx = torch.nonzero(visible).flatten()
            assert count[i] == idx.numel()
            assert idx.tolist() == list(range(int(first[i]), keys.numel()))  # a suffix of the cache


def test_window_visibility_rule():
    q = torch.tensor([10, 12])
    k = torch.tensor([0, 3, 9, 10, 11])
    assert window_visibility(q, k, 4).tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    assert window_visibility(q, k, 0).tolist() == [[True, True, True, True, False], [True] * 5]


def test_record_step_free_and_reuse():
    batch = make_batch([1, 300, 280], [50, 0, 0], (16,))
    base = batch.layout()
    kept1, counts1 = random_drop(batch, {1, 2}, seed=10, keep=0.5)
    l1 = compact(base, torch.tensor(kept1), torch.tensor(counts1))
    qsl = l1.query_start_loc_cpu.tolist()
    rel = [i for r in range(3) for i in range(qsl[r], qsl[r + 1]) if r == 0 or i % 2 == 0 or i == qsl[r + 1] - 1]
    counts2 = [sum(1 for i in rel if qsl[r] <= i < qsl[r + 1]) for r in range(3)]
    l2 = compact(l1, torch.tensor(rel), torch.tensor(counts2))
    store = DropHistoryStore(DROPS, NUM_LAYERS, max_window=32)
    rows = store.record_step(["dec", "p1", "p2"], base, [l1, l2], torch.tensor([False, True, True]))
    assert len(store) == 2 and "dec" not in store and rows == [1, 2]
    h = store.get("p1")
    assert (h.context_len, h.prompt_len) == (0, 300)
    assert h.drops[0].kept_len == counts1[1] and h.drops[1].kept_len == counts2[1]
    assert h.drops[1].kept_positions.tolist() == l2.positions[qsl_slice(l2, 1)].tolist()
    # the window tables filled from record_step's batched host copy agree with the position rule
    for rid, pos in (("p1", 300), ("p2", 290), ("p2", 281)):
        hist = store.get(rid)
        for layer in range(NUM_LAYERS):
            for window in (8, 32):
                first, count = store.window_first_visible(store.rows_for([rid]), torch.tensor([pos]), layer, window)
                keys = hist.key_positions(layer, pos - hist.prompt_end + 1)
                idx = torch.nonzero(window_visibility(torch.tensor([pos]), keys, window)[0]).flatten()
                assert (int(first[0]), int(count[0])) == (keys.numel() - idx.numel(), idx.numel())
    batch = ["p2", "p1", "x"]
    decode = store.rows_for(batch)
    assert store.rows_for(tuple(batch)) is decode  # the same batch again: no lookups (decode steps)
    assert store.free("p1") and not store.free("p1") and not store.free("never-seen")
    assert "p1" not in store and store.rows_for(["p1"]).tolist() == [0]
    assert store.rows_for(batch).tolist() == [decode[0].item(), 0, 0]  # the store changed: looked up again
    assert store.layer_kv_lens(torch.tensor([1]), torch.tensor([9])).tolist() == [[9] * NUM_LAYERS]  # row zeroed
    assert store.add(make_history("new", 0, 300, seed=5)) == 1  # freed row reused
    with pytest.raises(ValueError, match=r"request 'new' already has a drop history"):
        store.add(make_history("new", 0, 300, seed=5))


def qsl_slice(layout, r):
    return slice(int(layout.query_start_loc_cpu[r]), int(layout.query_start_loc_cpu[r + 1]))


def test_store_rejects_inconsistent_inputs():
    store = DropHistoryStore(DROPS, NUM_LAYERS, max_window=16)
    with pytest.raises(ValueError, match=r"has drop layers \[2\], expected this store's \[2, 5\]"):
        store.add(RequestDropHistory("a", 0, 10, (DropRecord(2, 3, torch.tensor([1, 2, 9])),)))
    with pytest.raises(ValueError, match=r"kept_positions has shape \(2,\), expected \(3,\)"):
        store.add(RequestDropHistory("a", 0, 10, (DropRecord(2, 3, torch.tensor([1, 9])),
                                                  DropRecord(5, 1, torch.tensor([9])))))
    store.add(make_history("a", 0, 300, seed=1))
    with pytest.raises(ValueError, match=r"window=32: expected 1 <= window <= max_window=16"):
        store.window_first_visible(torch.tensor([1]), torch.tensor([300]), 6, 32)
    with pytest.raises(ValueError, match=r"decode queries must lie at or after the prompt end; got \[299\] before \[300\]"):
        store.window_first_visible(torch.tensor([1]), torch.tensor([299]), 6, 8)
    with pytest.raises(ValueError, match=r"seq_lens_cpu: expected shape \(1,\), got \(2,\)"):
        store.layer_kv_lens(torch.tensor([1]), torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"drop_layers=\[5, 2\] must be increasing"):
        DropHistoryStore((5, 2), NUM_LAYERS)
    with pytest.raises(ValueError, match=r"drop_layers=\[2, 9\] must be increasing layer indices in \[0, 8\)"):
        DropHistoryStore((2, 9), NUM_LAYERS)


# ----------------------------------------------------------------------------- the vLLM plugin (no vLLM needed)
NS = types.SimpleNamespace


def fake_vllm_config(mode=2, backend=BACKEND_QUALNAME, settings=None, tp=1, pp=1, spec=None):
    inductor = {"enable_auto_functionalized_v2": False}  # vLLM adds this key itself
    if settings is not None:
        inductor["uniprefill"] = settings
    return NS(compilation_config=NS(mode=mode, backend=backend, inductor_compile_config=inductor),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              cache_config=NS(enable_prefix_caching=True), scheduler_config=NS(enable_chunked_prefill=True),
              speculative_config=spec)


def test_config_parsing_from_dict_and_object():
    assert config_from_compilation_config({"mode": 2}) is None
    assert config_from_compilation_config({"inductor_compile_config": {"uniprefill": {}}}) == UniPrefillConfig()
    cfg = config_from_compilation_config({"inductor_compile_config": {"uniprefill": {"p": 0.9, "drop_layers": [11, 7]}}})
    assert (cfg.p, cfg.drop_layers) == (0.9, (7, 11))
    obj = fake_vllm_config(settings={"policy": "suspend"}).compilation_config
    assert config_from_compilation_config(obj).policy == "suspend"


@pytest.mark.parametrize("settings, match", [
    ({"top_p": 0.5}, r"inductor_compile_config\['uniprefill'\]: unknown uniprefill option\(s\) \['top_p'\]"),
    ({"p": 1.5}, r"inductor_compile_config\['uniprefill'\]: p=1.5 is outside \(0.0, 1.0\]"),
    (0.9, r"expected a dict of UniPrefillConfig fields, got float 0.9"),
])
def test_config_parsing_errors(settings, match):
    with pytest.raises(ValueError, match=match):
        config_from_compilation_config({"inductor_compile_config": {"uniprefill": settings}})


def test_vllm_config_checks():
    ok = check_vllm_config(fake_vllm_config(settings={}), "0.26.0")
    assert ok.errors == [] and any("prefix caching" in n for n in ok.notes)
    assert any("without Inductor's fusion" in n and "compare with standard vLLM" in n for n in ok.notes)
    chunked = fake_vllm_config(settings={})
    chunked.scheduler_config.max_num_batched_tokens, chunked.model_config = 8192, NS(max_model_len=32768)
    assert any("a prompt longer than 8192 tokens" in n and "drops among the tokens of its last step" in n
               for n in check_vllm_config(chunked).notes)
    chunked.compilation_config.inductor_compile_config["uniprefill"]["vllm_context_drops"] = False
    assert any("a prompt longer than 8192 tokens" in n and "runs unaccelerated" in n
               for n in check_vllm_config(chunked).notes)
    dropping = check_vllm_config(fake_vllm_config(settings={}), "0.26.0", drop_enabled=True)
    assert dropping.errors == [] and any("publish no KV blocks from the step that ends their prompt" in n for n in dropping.notes)
    custom = fake_vllm_config(settings={})  # a scheduler the prefix-cache guard does not wrap
    custom.scheduler_config.scheduler_cls = "my.pkg.MyScheduler"
    (error,) = check_vllm_config(custom, "0.26.0", drop_enabled=True).errors
    assert "scheduler_cls='my.pkg.MyScheduler'" in error and "enable_prefix_caching=False" in error
    assert check_vllm_config(custom, "0.26.0", drop_enabled=False).errors == []
    assert check_vllm_config(fake_vllm_config(mode="DYNAMO_TRACE_ONCE")).errors == []
    bad = check_vllm_config(fake_vllm_config(mode=2, backend="inductor", pp=2, spec=object()), "0.33.0")
    assert len(bad.errors) == 3 and "expected 'uniprefill.vllm.plugin" in bad.errors[0]
    default = check_vllm_config(fake_vllm_config(mode=3, backend="inductor"), "0.26.0", drop_enabled=True)
    assert default.errors == []  # vLLM's default mode: the rewrite runs in front of its backend (vllm.piecewise)
    (error,) = check_vllm_config(fake_vllm_config(mode=3), "0.26.0").errors  # with the mode-2 backend string
    assert "leave the backend at vLLM's default" in error
    (error,) = check_vllm_config(fake_vllm_config(mode=0, backend="inductor"), "0.26.0").errors
    assert "mode=0" in error and "expected 3 (VLLM_COMPILE" in error
    assert any("0.33.0 is untested" in n for n in bad.notes)
    with pytest.raises(ValueError, match="cannot run with this vLLM configuration"):
        bad.raise_if_errors()
    assert any("tensor_parallel_size" in n for n in check_vllm_config(fake_vllm_config(tp=2)).notes)
    pooling = fake_vllm_config()  # an embedding or reward model reads every token's hidden state
    pooling.model_config = NS(runner_type="pooling", max_model_len=4096)
    assert [e for e in check_vllm_config(pooling).errors if "runner_type='pooling'" in e and "generation only" in e]
    pooling.model_config.runner_type = "generate"
    assert check_vllm_config(pooling).errors == []
    sparse = check_vllm_config(fake_vllm_config(settings={"early_sparse_keep": 0.1}))  # Hugging Face backend only
    assert [e for e in sparse.errors if "early_sparse_p / early_sparse_keep" in e]
    # full decode graphs (kept by vLLM in mode 2) would replay decode steps without the drop histories
    graphs = fake_vllm_config(settings={})
    graphs.cache_config.enable_prefix_caching = False
    graphs.compilation_config.cudagraph_mode = NS(name="FULL_DECODE_ONLY")  # vLLM's CUDAGraphMode enum member
    (error,) = check_vllm_config(graphs, drop_enabled=True).errors
    assert "cudagraph_mode=FULL_DECODE_ONLY with token dropping" in error
    assert check_vllm_config(graphs, drop_enabled=False).errors == []  # nothing drops: the graphs are vLLM's own
    graphs.compilation_config.cudagraph_mode = NS(name="NONE")
    assert check_vllm_config(graphs, drop_enabled=True).errors == []
    # mode 2 + vLLM's AOT compile (default on torch >= 2.10) needs a serialisable compiled function
    aot = check_vllm_config(fake_vllm_config(mode=2), aot_compile=True)
    assert len(aot.errors) == 1 and "VLLM_USE_AOT_COMPILE=0" in aot.errors[0]
    assert check_vllm_config(fake_vllm_config(mode=1), aot_compile=True).errors == []


def test_register_is_idempotent_and_imports_nothing(tmp_path):
    """In a fresh interpreter, run outside the source tree: the installed package (on the GPU box the source tree,
    which has no `uniprefill.kernels`, would shadow the installed one and fail the import, 2026-12-06)."""
    code = (
        "import sys, uniprefill\n"
        "assert 'uniprefill.vllm.plugin' not in sys.modules\n"
        "from uniprefill.vllm import plugin as p\n"
        "p.register(); p.register()\n"
        "assert p.plugin_loaded()\n"
        "assert 'vllm' not in sys.modules and 'torch._dynamo' not in sys.modules, 'register imported too much'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_entry_point_declared():
    from importlib.metadata import entry_points

    values = {ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "uniprefill"}
    assert values == {"uniprefill.vllm.plugin:register"}


def test_vllm_backend_binds_the_current_vllm_config(monkeypatch):
    current = {"config": fake_vllm_config(settings={"p": 0.95})}
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.__version__ = "0.26.0"
    fake_config = types.ModuleType("vllm.config")
    fake_config.get_current_vllm_config = lambda: current["config"]
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", fake_config)
    backend = vllm_plugin.vllm_backend  # what vLLM's resolve_obj_by_qualname does
    assert isinstance(backend, VllmTokenDropBackend) and backend.config.p == 0.95
    assert vllm_plugin.vllm_backend is not backend  # one backend per resolution, no module state
    current["config"] = fake_vllm_config(settings={"p": 0})
    with pytest.raises(ValueError, match=r"inductor_compile_config\['uniprefill'\]: p=0"):
        vllm_plugin.vllm_backend
    current["config"] = fake_vllm_config(settings=None)
    with pytest.raises(ValueError, match="has no 'uniprefill' entry"):
        vllm_plugin.vllm_backend
    current["config"] = fake_vllm_config(mode=3, settings={})
    with pytest.raises(ValueError, match=r"mode 3 \(VLLM_COMPILE\): leave the backend"):
        vllm_plugin.vllm_backend


def test_vllm_backend_without_vllm_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="needs vllm installed"):
        vllm_plugin.vllm_backend


def unified_kv_cache_update(k, v, layer_name):
    return k


def unified_attention_with_output(q, k, v, out, layer_name):
    return q + v


def test_backend_runs_graph_unaccelerated_with_reason():
    graph = fx.Graph()
    x = graph.placeholder("hidden_states")
    for i in range(2):
        graph.call_function(unified_kv_cache_update, (x, x, f"layers.{i}.attn"))
        x = graph.call_function(unified_attention_with_output, (x, x, x, x, f"layers.{i}.attn"))
    graph.output(x)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    backend = VllmTokenDropBackend(config_from_compilation_config({"inductor_compile_config": {"uniprefill": {}}}))
    with pytest.warns(UserWarning, match="running the vLLM graph unaccelerated"):
        fn = backend(gm, [torch.ones(3)])
    assert fn(torch.ones(3)).tolist() == [4.0] * 3
    report = backend.graphs[0]
    assert not report.rewritten and report.graph_ops == {"attention": 2, "kv_cache_update": 2, "gdn": 0, "placeholders": 1}
    strict = VllmTokenDropBackend(config_from_compilation_config({"inductor_compile_config": {"uniprefill": {"strict": True}}}))
    with pytest.raises(RuntimeError, match="cannot rewrite this vLLM graph"):
        strict(gm, [torch.ones(3)])


def _real_flash_metadata_class():
    """A dataclass with exactly the fields of vLLM 0.26's FlashAttentionMetadata as the H200
    dump recorded them (docs/results/vllm-dump-gemma-270m-h200.tar.gz)."""
    import json
    import tarfile
    from pathlib import Path

    dump = Path(__file__).resolve().parents[2] / "docs" / "results" / "vllm-dump-gemma-270m-h200.tar.gz"
    with tarfile.open(dump) as tar:
        call = json.load(tar.extractfile("vllm-dump/call-3.json"))
    group = call["forward_context"]["attn_metadata"]["distinct"][0]
    assert group["class"].endswith("FlashAttentionMetadata")
    return dataclasses.make_dataclass("FlashAttentionMetadata", [(name, object) for name in group["fields"]])


def test_install_layer_metadata_gives_the_later_layers_compacted_metadata_one_copy_per_vllm_object():
    from uniprefill.vllm.metadata import install_layer_metadata

    Meta = _real_flash_metadata_class()
    batch = make_batch([1, 300, 40], [12, 0, 0], (16, 16))  # two KV-cache groups, as Gemma-3 has six
    kept, counts = random_drop(batch, {1, 2}, seed=3)
    layout = batch.layout()
    out = compact(layout, torch.tensor(kept), torch.tensor(counts))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    group_of = {name: i % 2 for i, name in enumerate(names)}  # groups run across the depth
    shared = []
    for g in range(2):
        fields = {f.name: None for f in dataclasses.fields(Meta)}
        fields.update(layout.flash_attention_fields(g), block_table=layout.block_tables[g], use_cascade=False,
                      causal=True, sliding_window=(511, 0) if g == 0 else None)
        shared.append(Meta(**fields))
    attn = {name: shared[group_of[name]] for name in names}
    slots = {name: layout.slot_mappings[group_of[name]] for name in names}
    before = dict(attn)
    later = {name: group_of[name] for name in names[2:]}  # a drop after layer 1's attention
    install_layer_metadata(attn, slots, later, out)
    assert attn[names[0]] is before[names[0]] and attn[names[1]] is before[names[1]]
    assert slots[names[0]] is layout.slot_mappings[0]
    # one copy per object vLLM gave (a KV-cache group's layers share theirs), none of them vLLM's
    assert len({id(attn[n]) for n in names[2:]}) == 2 and not {id(attn[n]) for n in names[2:]} & {id(m) for m in shared}
    assert attn[names[2]] is attn[names[4]] and attn[names[3]] is attn[names[5]]
    for name in names[2:]:
        meta, g = attn[name], group_of[name]
        assert meta.num_actual_tokens == len(kept) and meta.max_query_len == max(counts)
        assert torch.equal(meta.query_start_loc, out.query_start_loc) and torch.equal(meta.seq_lens, out.seq_lens)
        assert meta.slot_mapping is out.slot_mappings[g] and slots[name] is out.slot_mappings[g]
        assert meta.block_table is layout.block_tables[g] and meta.sliding_window == ((511, 0) if g == 0 else None)
    cascade = {"x": dataclasses.replace(shared[0], use_cascade=True)}
    with pytest.raises(NotImplementedError, match="cascade"):
        install_layer_metadata(cascade, {}, {"x": 0}, out)
    planned = {"x": dataclasses.replace(shared[0], scheduler_metadata=torch.zeros(1)), "y": shared[0]}
    install_layer_metadata(planned, {}, {"x": 0}, out)  # FA3's plan for the full batch: cleared on the copy
    assert planned["x"].scheduler_metadata is None and planned["x"].num_actual_tokens == len(kept)
    assert planned["y"] is shared[0]  # layers not named keep vLLM's object (and its plan)
    with pytest.raises(KeyError, match="no attention metadata"):
        install_layer_metadata({}, {}, {"x": 0}, out)


def test_backend_reads_layer_kinds_window_and_block_size_from_the_vllm_config():
    """What the rewrite needs of the model comes from vLLM's config: layer kinds and the
    sliding window from its Hugging Face text config, the block size from the cache config."""
    config = fake_vllm_config(settings={"p": 0.95})
    types_ = ["sliding_attention"] * 5 + ["full_attention"]
    config.model_config = NS(hf_text_config=NS(num_hidden_layers=18, layer_types=types_ * 3, sliding_window=512))
    config.cache_config.block_size = 16
    backend = VllmTokenDropBackend.from_vllm_config(config, "0.26.0", aot_compile=False)
    assert backend.layer_kinds == (["sliding"] * 5 + ["full"]) * 3
    assert backend.sliding_window == 512 and backend.block_size == 16 and backend.config.p == 0.95


def test_dropping_on_an_unverified_vllm_version_is_refused_unless_allowed(monkeypatch):
    config = fake_vllm_config(settings={})
    config.cache_config.enable_prefix_caching = False
    assert check_vllm_config(config, "0.26.0", drop_enabled=True).errors == []
    assert check_vllm_config(config, "0.26.0+cu130", drop_enabled=True).errors == []
    refused = check_vllm_config(config, "0.27.1", drop_enabled=True)
    assert len(refused.errors) == 1 and "vLLM 0.27.1 with token dropping" in refused.errors[0]
    assert '"vllm_allow_untested": true' in refused.errors[0]
    channel_only = check_vllm_config(config, "0.27.1", drop_enabled=False)  # unaccelerated: a note only
    assert channel_only.errors == [] and any("0.27.1 is untested" in n for n in channel_only.notes)
    config.compilation_config.inductor_compile_config["uniprefill"] = {"vllm_allow_untested": True}
    allowed = check_vllm_config(config, "0.27.1")
    assert allowed.errors == [] and any("0.27.1 is untested" in n for n in allowed.notes)
    config.compilation_config.inductor_compile_config["uniprefill"] = {"vllm_allow_untested": True, "vllm_drop": True}
    allowed = check_vllm_config(config, "0.27.1")  # the drop switch read from the same dict
    assert allowed.errors == [] and any("0.27.1 is untested" in n for n in allowed.notes)


def test_backend_warms_the_kernels_up_to_max_model_len_only_where_triton_runs_them(monkeypatch):
    from uniprefill.vllm import plugin as vllm_plugin
    from uniprefill.config import UniPrefillConfig

    config = fake_vllm_config(settings={})
    config.model_config = NS(max_model_len=32768)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dropping = UniPrefillConfig(vllm_drop=True)
    assert vllm_plugin._warm_up_max_seqlen(config, dropping) == 32768
    assert vllm_plugin._warm_up_max_seqlen(config, UniPrefillConfig(impl="torch", vllm_drop=True)) == 0  # no Triton
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_plugin._warm_up_max_seqlen(config, dropping) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_plugin._warm_up_max_seqlen(config, UniPrefillConfig()) == 0  # nothing drops, nothing to warm


def test_the_former_environment_switches_are_config_fields_now(monkeypatch):
    """Behaviour is configured, not switched by the environment: the old variables only earn a note
    naming the option that replaced them, and the options travel in the uniprefill dict."""
    config = fake_vllm_config(settings={})
    config.cache_config.enable_prefix_caching = False
    monkeypatch.setenv("UNIPREFILL_VLLM_DROP", "1")
    check = check_vllm_config(config, "0.27.1")  # an unverified version: refused only when dropping
    assert check.errors == []  # the variable does not switch dropping on
    assert any('UNIPREFILL_VLLM_DROP is no longer read: give "vllm_drop": true' in n for n in check.notes)
    config.compilation_config.inductor_compile_config["uniprefill"] = {"vllm_drop": True}
    assert len(check_vllm_config(config, "0.27.1").errors) == 1
    with pytest.raises(ValueError, match="vllm_drop='yes' must be True or False"):
        UniPrefillConfig(vllm_drop="yes")
    assert UniPrefillConfig().stable_hash() == UniPrefillConfig(vllm_drop=False).stable_hash()
    assert UniPrefillConfig().stable_hash() != UniPrefillConfig(vllm_drop=True).stable_hash()


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=ON_CPU)])
def test_the_slots_of_many_kv_cache_groups_equal_each_groups_own(impl):
    """`compact` computes the slots of every group of one block size in one row kernel (`kernels.layout_rows`: up to
    8 tables a launch; Gemma-3-270M has 6 groups): 12 groups of two block sizes (10 of one: two launches) and table
    widths, each group's slots equal `_slots` of that group's table at each row's request and logical index, and
    the brute force's."""
    from uniprefill.vllm.layout import _slots

    block_sizes = (16, 16, 32, 16, 16, 16, 32, 16, 16, 16, 16, 16)
    batch = make_batch([40, 1, 77, 20], [0, 300, 12, 64], block_sizes, seed=9, extra_blocks=3)
    batch.tables[3] = torch.cat([batch.tables[3], batch.tables[3]], dim=1)  # a wider table
    layout = batch.layout(impl=impl)
    kept, counts = random_drop(batch, {0, 2}, seed=4)
    for removed in (None, [0, 120, 0, 0]):
        out = compact(layout, torch.tensor(kept), torch.tensor(counts), validate="full",
                      kv_removed_cpu=None if removed is None else torch.tensor(removed))
        for g, (table, block) in enumerate(zip(batch.tables, block_sizes)):
            assert torch.equal(out.slot_mapping(g), _slots(table, block, out.row_request, out.row_logical)), g
        assert_matches(out, reference_compact(batch, kept, removed))


def test_compact_computes_the_slot_mappings_of_the_groups_asked_for_only():
    """`slot_groups`: the drop point computes the slots of the groups whose layers run on a layout (Gemma-3-270M:
    the full layers' group on the left layout, the sliding ones' on the right); those equal what compacting every
    group gives, and asking for a group left out raises instead of handing vLLM a wrong or missing mapping."""
    batch = make_batch([40, 25, 1], [0, 10, 30], block_sizes=(16, 16, 32))
    layout = batch.layout()
    kept, counts = random_drop(batch, {0, 1}, seed=3)
    kept, counts = torch.tensor(kept), torch.tensor(counts)
    for align in ("left", "right"):
        every = compact(layout, kept, counts, align=align, validate="full")
        some = compact(layout, kept, counts, align=align, validate="full", slot_groups={0, 2})
        assert some.slot_mappings[1] is None
        for g in (0, 2):
            assert torch.equal(some.slot_mapping(g), every.slot_mappings[g]), (align, g)
            assert some.flash_attention_fields(g)["slot_mapping"] is some.slot_mappings[g]
        with pytest.raises(ValueError, match="group 1: this layout's slot mapping was not computed"):
            some.flash_attention_fields(1)
        assert torch.equal(some.query_start_loc, every.query_start_loc) and torch.equal(some.seq_lens, every.seq_lens)
