"""Inductor's Triton code for the pieces of a rewritten mode-3 graph, generated on a CPU-only machine.

    python scripts/gpu/vllm/triton_pieces_on_cpu.py [--unbacked] [--drops 1,2] [--json] [--out pieces.txt]
    python scripts/gpu/vllm/triton_pieces_on_cpu.py --gemma [--unbacked] [--json]

A diagnosis aid for vLLM p = 1 parity (docs/results/vllm-defaults-h200-2026-12-04/): it runs the fake
vLLM of tests/vllm (split at the attention ops and uniprefill's splitting ops, each piece compiled by
Inductor as vLLM compiles it) on a tiny model with vLLM-style fused add + RMSNorm layers, with
Inductor's CPU backend set to Triton and Triton's driver stubbed, so Inductor generates the Triton
kernels a GPU would get without compiling or running them. It prints each compiled piece's kernels and
compares the RMSNorm kernels of the pieces after the drop point (layer 1) with those of the piece before
it. `--unbacked` compiles the pieces for the drop's unbacked row count (uniprefill before
`backed_rows.py`). `--gemma` compiles vLLM's REAL Gemma-3-270M graph instead (the H200 dump of mode 2 in
`tests/vllm/test_vllm_real_graph.py`, in bf16, sliding windows, drops after layers 5, 11 and 17) twice, as
standard vLLM and at p = 1, and compares every kernel of the one with the kernel at the same place in the other.
Relies on private Inductor and Triton internals (written against torch 2.13).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]


def stub_triton(codes: list[str]) -> None:
    """Inductor generates Triton code for CPU tensors; nothing is compiled or run; every generated
    module's source is appended to `codes`."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.codecache as codecache
    import torch._inductor.codegen.wrapper as wrapper
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    inductor_config.force_disable_caches = True
    triton_utils.triton_hash_with_backend = lambda: "stub"
    triton_utils.triton_backend = lambda: None

    class Kernel:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, *args, **kwargs):
            raise RuntimeError("stub kernel: code generated, not run")

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    async_compile.AsyncCompile.triton = lambda self, name, source, *args, **kwargs: Kernel()
    wrapper.PythonWrapperCodegen.generate_and_run_autotune_block = lambda self: None
    load = codecache.PyCodeCache.load_by_key_path.__func__

    def load_and_keep(cls, key, path, *args, **kwargs):
        codes.append(Path(path).read_text())
        return load(cls, key, path, *args, **kwargs)

    codecache.PyCodeCache.load_by_key_path = classmethod(load_and_keep)


def kernels(code: str) -> dict[str, str]:
    """Kernel name -> source with names and hashes blanked."""
    out = {}
    for match in re.finditer(r"^(\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, re.M | re.S):
        body = re.sub(r"triton_\w+", "KERNEL", match.group(2))
        out.setdefault(match.group(1), re.sub(r"'backend_hash': '[^']*'", "HASH", body))
    return out


def normalised_kernels(codes: list[str]) -> list[tuple[str, str]]:
    """(name, source) of every kernel in `codes`, in order; names, hashes and the tiling-score metadata (size
    hints, which differ by one between a row count and the next) blanked."""
    from diff_kernels import _BLANKS

    out = []
    for code in codes:
        for name, body in kernels(code).items():
            for pattern, blank in _BLANKS:
                body = pattern.sub(blank, body)
            out.append((name, re.sub(r"'tiling_scores': \{[^}]*\}", "'tiling_scores': S", body)))
    return out


def gemma_report(codes: list[str], unbacked: bool) -> dict:
    """Standard vs p = 1 on vLLM's real Gemma-3-270M graph: kernel counts and the places whose code differs."""
    import test_vllm_real_graph as real
    from fake_vllm_compile import FakeVllmBackend, fake_mode3_config
    from uniprefill.vllm import backed_rows, piecewise
    from uniprefill.vllm.plugin import VllmHooks

    hooks = VllmHooks(context_fn=lambda: real.WORLD.context, request_ids_fn=lambda: real.WORLD.context.request_ids,
                      num_prompt_tokens_fn=lambda: None, listeners=types.SimpleNamespace(add=lambda runtime: None),
                      window_layer_fn=real.window_layer)
    VllmHooks.from_vllm = classmethod(lambda cls: hooks)
    piecewise.install(FakeVllmBackend)
    if unbacked:
        backed_rows.back_kept_row_counts = lambda gm: backed_rows.BackedRows({})
    backbone = real.VllmGemmaBackbone(*real._load_dump(torch.bfloat16), dtype=torch.bfloat16).eval()
    splitting = [f"{real.NS}::unified_attention_with_output", f"{real.NS}::unified_kv_cache_update"]
    sliding = (tuple(i for i in range(real.LAYERS) if i not in real.FULL), real.WINDOW)
    p1 = {"p": 1.0, "block_size": real.BLOCK, "last_q": 32, "sink": 32, "min_tokens": 64, "vllm_drop": True,
          "drop_layers": list(real.FULL)}
    query_lens = [300, 40, 220]
    ids = torch.randint(0, real.VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(q) for q in query_lens])
    generated = {}
    for name, settings in (("standard", None), ("p1", p1)):
        torch._dynamo.reset()
        codes.clear()
        config = fake_mode3_config(settings, layers=real.LAYERS, block=real.BLOCK, splitting_ops=splitting,
                                   sliding=sliding)
        compiled = torch.compile(backbone, backend=lambda gm, example: FakeVllmBackend(config)(gm, example),
                                 dynamic=True, fullgraph=True)
        real.WORLD.context = real.new_world(query_lens, torch.bfloat16)
        try:
            with torch.no_grad():
                compiled(ids.to(torch.int32), positions)
        except Exception as error:  # the stubbed kernels refuse to run, once every piece is compiled
            if "stub kernel" not in str(error):
                raise
        generated[name] = normalised_kernels([code for code in codes if "def call" in code])
    standard, ours = generated["standard"], generated["p1"]
    differing = [i for i, (a, b) in enumerate(zip(standard, ours)) if a[1] != b[1]]
    return {"row_counts": "unbacked" if unbacked else "backed", "kernels": [len(standard), len(ours)],
            "differing": differing, "first_difference": None if not differing else
            [standard[differing[0]][0], ours[differing[0]][0]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unbacked", action="store_true", help="compile the pieces for unbacked row counts")
    parser.add_argument("--out", type=Path, default=None, help="write the generated modules here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead (tests read it)")
    parser.add_argument("--drops", default="1", help="drop layers, comma-separated (default 1; the model has 4)")
    parser.add_argument("--gemma", action="store_true", help="vLLM's real Gemma-3-270M graph, standard vs p = 1")
    args = parser.parse_args()
    codes: list[str] = []
    stub_triton(codes)
    if args.gemma:
        report = gemma_report(codes, args.unbacked)
        print(json.dumps(report) if args.json else
              f"row counts: {report['row_counts']}; kernels standard / p = 1: {report['kernels']}; "
              f"{len(report['differing'])} differ (first: {report['first_difference']})")
        return 0

    from torch import nn

    import fake_vllm_model as fm
    from fake_vllm_compile import FakeVllmBackend
    from fake_vllm_model import DIM, HEADS, HIDDEN, LAYERS, fake_context, rope
    from test_vllm_piecewise import SETTINGS, batch, compile_mode3
    from uniprefill.vllm import backed_rows, piecewise
    from uniprefill.vllm.plugin import VllmHooks

    def add_rms_norm(x, residual, weight):  # vLLM's RMSNorm.forward_native with a residual
        x = x.float() + residual.float()
        residual = x.to(torch.bfloat16)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return x.to(torch.bfloat16) * weight, residual

    class NormBackbone(fm.TinyBackbone):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.ParameterList(nn.Parameter(torch.ones(HIDDEN)) for _ in range(LAYERS))
            self.norm2 = nn.ParameterList(nn.Parameter(torch.ones(HIDDEN)) for _ in range(LAYERS))

        def forward(self, input_ids, positions):
            x = self.embed(input_ids)
            residual = torch.zeros_like(x)
            for i in range(LAYERS):
                name = f"model.layers.{i}.self_attn.attn"
                q, k, v = self.qkv[i](x).view(-1, 3, HEADS, DIM).unbind(1)
                q, k = rope(q, positions), rope(k, positions)
                out = torch.empty((q.shape[0], HEADS, DIM))
                dep = torch.ops.uniprefill_fakevllm.unified_kv_cache_update(k, v, name)
                torch.ops.uniprefill_fakevllm.unified_attention_with_output(q, k, v, out, name, kv_cache_dummy_dep=dep)
                x, residual = add_rms_norm(self.o[i](out.view(-1, HEADS * DIM)), residual, self.norm1[i])
                x, residual = add_rms_norm(self.mlp[i](x), residual, self.norm2[i])
            return x + residual

    hooks = VllmHooks(context_fn=lambda: fm.WORLD.context, request_ids_fn=lambda: fm.WORLD.context.request_ids,
                      num_prompt_tokens_fn=lambda: None, listeners=types.SimpleNamespace(add=lambda runtime: None))
    VllmHooks.from_vllm = classmethod(lambda cls: hooks)
    piecewise.install(FakeVllmBackend)
    if args.unbacked:
        backed_rows.back_kept_row_counts = lambda gm: backed_rows.BackedRows({})
    drop_layers = [int(layer) for layer in args.drops.split(",")]
    compiled, _ = compile_mode3(NormBackbone().eval(), dict(SETTINGS, drop_layers=drop_layers))
    query_lens = [300, 40, 170]
    ids, positions = batch(query_lens)
    fm.WORLD.context = fake_context(query_lens)
    try:
        with torch.no_grad():
            compiled(ids, positions)
    except Exception as error:  # the stubbed kernels refuse to run, once everything is compiled
        if "stub kernel" not in str(error):
            raise
    pieces = [code for code in codes if "def call" in code]
    before = [body for name, body in kernels(pieces[1]).items() if "rsqrt" in name]
    report = {"row_counts": "unbacked" if args.unbacked else "backed",
              "pieces": [list(kernels(code)) for code in pieces], "rmsnorm_vs_piece_1": {}}
    lines = [f"row counts: {report['row_counts']}; {len(pieces)} compiled pieces (drops after layers {args.drops})"]
    lines += [f"piece {index}: {names}" for index, names in enumerate(report["pieces"])]
    for index in range(2, len(pieces)):
        after = [body for name, body in kernels(pieces[index]).items() if "rsqrt" in name]
        diffs = [[line for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
                  if line[:1] in "+-" and not line.startswith(("+++", "---")) and "tiling_scores" not in line]
                 for a, b in zip(before, after)]
        report["rmsnorm_vs_piece_1"][index] = {"kernels": [len(after), len(before)],
                                               "differing_lines": [len(d) for d in diffs]}
        lines.append(f"piece {index} vs piece 1, RMSNorm kernels: {len(after)} vs {len(before)}; differing lines "
                     f"per pair, tiling_scores left out: {[len(d) for d in diffs]}"
                     + "".join(f"\n    {line[:160]}" for d in diffs for line in d[:6]))
    print(json.dumps(report) if args.json else "\n".join(lines))
    if args.out:
        args.out.write_text("\n##### piece\n".join(pieces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
