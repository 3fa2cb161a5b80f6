"""The Triton code Inductor generates for the pieces after a drop point (`scripts/gpu/vllm/triton_pieces_on_cpu.py`,
Triton's driver stubbed, nothing compiled or run): what the GPU gets, checked on CPU.

On the H200 (2026-12-04) the pieces after a drop, compiled for an unbacked row count, had their RMSNorms
split in two kernels, and p = 1 parted from standard vLLM. With backed row counts (`backed_rows.py`) their
RMSNorm kernels must be the ones of the piece before the drop, line for line (the tiling-score metadata
aside), and compiling them must not trip `BackedRows.unsound_reason` (Inductor's Triton code assumes a
view's divisibility on the row count, which its C++ code does not). A subprocess: the script patches
Inductor and Triton process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "triton_pieces_on_cpu.py"


def report(*flags: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [(), ("--drops", "1,2"), ("--unbacked",)],
                         ids=["backed", "backed-two-drops", "unbacked"])
def test_pieces_after_the_drop_get_the_rmsnorm_kernels_of_the_piece_before_it(flags):
    out = report(*flags)
    # the gathers at the drop are ops of their own (`uniprefill::gather_rows`): on the H200 Inductor fused the
    # residual's index_select into the next add + RMSNorm, a looped reduction instead of vLLM's one-pass one
    assert not [k for piece in out["pieces"] for k in piece if "index_select" in k]
    after_drop = [out["rmsnorm_vs_piece_1"][str(piece)] for piece in (2, 3)]  # piece 4 also holds the final add
    if "--unbacked" not in flags:
        assert all(p["kernels"] == [2, 2] and p["differing_lines"] == [0, 0] for p in after_drop)
    else:  # the H200's finding, reproduced: each RMSNorm split into a reduction and a pointwise kernel
        assert all(any(n for n in p["differing_lines"]) for p in after_drop)
        assert any("per_fused_mean_pow" in k for k in out["pieces"][3])


def test_vllms_real_gemma_graph_at_p1_gets_standard_vllms_kernels():
    """vLLM's real Gemma-3-270M graph (the H200 dump of mode 2, whose rotary and GELU are vLLM's kernels where mode 3
    has PyTorch ops; bf16, sliding windows, drops after layers 5, 11 and 17),
    compiled as standard vLLM and at p = 1: the same Triton kernels in the same places, line for line (the
    tiling-score metadata aside). With unbacked row counts (`--unbacked`, run 2026-12-05) 50 of them differ and
    p = 1 has 148 kernels against 73. So where Gemma-3-270M at p = 1 parts from standard vLLM on the GPU (109 of
    120 prompts equal, 2026-12-05), the cause is not in what Inductor generates from the graph's pieces."""
    out = report("--gemma")
    assert out["row_counts"] == "backed"
    assert out["kernels"][0] == out["kernels"][1] > 50
    assert out["differing"] == [], out["first_difference"]
