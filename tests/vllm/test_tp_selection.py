"""Tensor-parallel selection: ranks holding different heads keep the same blocks (CPU, gloo)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from uniprefill.kernels import api

LENS, LAST_Q, HQ, HK, D, BLOCK = [700, 333], 32, 8, 4, 16, 16
# SelectionRule fields: a plain dict travels to the workers through torch.save / torch.load (weights only)
SELECT = dict(block_size=BLOCK, p=0.9, keep_ratio=None, sink=32, last_q=LAST_Q, min_tokens=0)


def _inputs():
    """Keys with a per-block bias along a direction the queries share: uneven attention."""
    gen = torch.Generator().manual_seed(0)
    total = sum(LENS)
    k = torch.randn(total, HK, D, generator=gen)
    direction = torch.randn(HK, D, generator=gen)
    blocks = torch.randn((total + BLOCK - 1) // BLOCK, generator=gen).repeat_interleave(BLOCK)[:total]
    k += 2.0 * blocks[:, None, None] * direction
    q = torch.randn(sum(min(LAST_Q, n) for n in LENS), HQ, D, generator=gen)
    q += direction.repeat_interleave(HQ // HK, 0)
    cu_k = torch.tensor([0, LENS[0], sum(LENS)], dtype=torch.int32)
    cu_q = torch.tensor([0, LAST_Q, 2 * LAST_Q], dtype=torch.int32)
    return q, k, cu_q, cu_k


_WORKER = """
import sys, torch, torch.distributed as dist
from uniprefill.kernels import api
rank, world, init_file, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
q, k, cu_q, cu_k, lens, select, hq_all, hk_all, d = torch.load(sys.argv[5])
hq, hk = hq_all // world, hk_all // world  # this rank's heads, as tensor parallelism splits them
sel = api.score_and_select(q[:, rank * hq:(rank + 1) * hq], k[:, rank * hk:(rank + 1) * hk], cu_q, cu_k,
                           max(lens), api.SelectionRule(**select), scale=d ** -0.5, impl="torch",
                           group=dist.group.WORLD)
torch.save((sel.block_scores, sel.block_keep, sel.kept_idx), out_file)
dist.destroy_process_group()
"""


def test_ranks_with_head_shards_keep_the_same_blocks_as_one_process(tmp_path):
    """Two gloo ranks, each with half of the q and kv heads, sum their block scores and keep
    bit-equal blocks: the blocks one process holding every head keeps."""
    world = 2
    q, k, cu_q, cu_k = _inputs()
    torch.save((q, k, cu_q, cu_k, LENS, SELECT, HQ, HK, D), tmp_path / "inputs.pt")
    (tmp_path / "worker.py").write_text(_WORKER)
    procs = [subprocess.Popen([sys.executable, "-P", str(tmp_path / "worker.py"), str(rank), str(world),
                               str(tmp_path / "init"), str(tmp_path / f"out{rank}.pt"), str(tmp_path / "inputs.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-2000:]
    results = [torch.load(tmp_path / f"out{rank}.pt") for rank in range(world)]
    whole = api.score_and_select(q, k, cu_q, cu_k, max(LENS), api.SelectionRule(**SELECT), scale=D**-0.5, impl="torch")
    scores0, keep0, idx0 = results[0]
    for scores, keep, idx in results[1:]:
        assert torch.equal(scores, scores0), "ranks must hold bit-equal summed scores"
        assert torch.equal(keep, keep0) and torch.equal(idx, idx0)
    assert torch.allclose(scores0, whole.block_scores, rtol=1e-5, atol=1e-7)
    assert torch.equal(keep0, whole.block_keep) and torch.equal(idx0, whole.kept_idx)
    assert 0 < keep0.sum() < keep0.numel(), "the case must drop some blocks and keep some"


def test_block_scores_must_be_float32_to_be_reduced():
    with pytest.raises(ValueError, match="float32"):
        api.reduce_block_scores(torch.zeros(4, dtype=torch.bfloat16), group=None)


_RUNTIME_WORKER = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[6])  # tests/: the fake vLLM of test_vllm_rewrite.py and fake_vllm.py
from test_vllm_rewrite import BLOCK, fake_context
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.drop import VllmDropRuntime
rank, world, init_file, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
q, k, query_lens, hq_all, hk_all = torch.load(sys.argv[5])
group = None
if world > 1:
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    group = dist.group.WORLD
hq, hk = hq_all // world, hk_all // world
context = fake_context(query_lens)
config = UniPrefillConfig(p=0.9, block_size=BLOCK, last_q=32, sink=32, min_tokens=64, impl="torch")
runtime = VllmDropRuntime(config, context.names, (1,), lambda: context, lambda name: BLOCK, group=group)
runtime.begin_step()
kept = runtime.drop(q[:, rank * hq:(rank + 1) * hq], k[:, rank * hk:(rank + 1) * hk], 1)
layout = runtime.step.layout
torch.save((kept, layout.query_start_loc_cpu, layout.slot_mappings, layout.positions), out_file)
if group is not None:
    dist.destroy_process_group()
"""


def test_vllm_runtime_ranks_compact_the_same_rows(tmp_path):
    """`VllmDropRuntime.drop` under tensor parallelism (two gloo ranks, half of the heads each,
    `group=` the TP group): both ranks keep the same rows and build the same compacted layout
    (slots, positions, query_start_loc) as one process holding every head."""
    from pathlib import Path

    tests_dir = Path(__file__).resolve().parent
    query_lens = [300, 40, 170]
    gen = torch.Generator().manual_seed(1)
    total = sum(query_lens)
    k = torch.randn(total, HK, D, generator=gen)
    direction = torch.randn(HK, D, generator=gen)
    # each KV head favours its own blocks, so the two ranks' halves of the heads disagree
    blocks = torch.randn((total + BLOCK - 1) // BLOCK, HK, generator=gen).repeat_interleave(BLOCK, 0)[:total]
    k += 2.0 * blocks[:, :, None] * direction
    q = torch.randn(total, HQ, D, generator=gen) + direction.repeat_interleave(HQ // HK, 0)
    torch.save((q, k, query_lens, HQ, HK), tmp_path / "inputs.pt")
    (tmp_path / "worker.py").write_text(_RUNTIME_WORKER)

    def run(world):
        procs = [subprocess.Popen([sys.executable, "-P", str(tmp_path / "worker.py"), str(rank), str(world),
                                   str(tmp_path / f"init{world}"), str(tmp_path / f"out{world}-{rank}.pt"),
                                   str(tmp_path / "inputs.pt"), str(tests_dir)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(world)]
        for proc in procs:
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, output[-2000:]
        return [torch.load(tmp_path / f"out{world}-{rank}.pt") for rank in range(world)]

    (whole,) = run(1)
    ranks = run(2)
    counts = (whole[1][1:] - whole[1][:-1]).tolist()
    assert counts[1] == 40 and counts[0] < 300 and counts[2] < 170, "two requests must drop, one keeps all"
    for kept, qsl, slots, positions in ranks:
        assert torch.equal(kept, whole[0]) and torch.equal(qsl, whole[1]) and torch.equal(positions, whole[3])
        assert all(torch.equal(a, b) for a, b in zip(slots, whole[2]))
