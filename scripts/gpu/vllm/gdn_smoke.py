"""One vLLM engine of a small Qwen3-Next (dummy weights) on vLLM's defaults plus the uniprefill option: do its
Gated DeltaNet layers after a drop point run on the kept rows (`uniprefill/vllm/gdn_metadata.py`) in real vLLM?

    source scripts/gpu/vllm/env.sh && bash scripts/gpu/vllm/box_refresh_uniprefill.sh
    python3 -P scripts/gpu/vllm/gdn_smoke.py --out $OUT/gdn [--settings JSON] [--words 3000] [--prompts 4]

Layers linear, full, linear, full (`word_llama.write_qwen3_next_folder`), the drop after layer 1, so the GDN
layer 2 and the attention layer 3 run on the kept rows. Prompts of `--words` words (tokens) and one short one,
8 greedy tokens each (decode after the drop). Writes `progress.txt` line by line (a run cut short still tells
how far it got) and `gdn-smoke.json`: the settings, the engine's start and generate times, the drop totals
(`collect_drop_totals`), each prompt's token ids. With dummy weights the tokens are noise: the run shows that
the engine builds, drops, rebuilds the GDN metadata, decodes and frees, not accuracy (the CPU tests compare
with a reference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", default='{"keep_ratio": 0.3, "drop_layers": [1], "vllm_drop": true, '
                                              '"impl": "torch"}')
    parser.add_argument("--words", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-next-tiny"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = (args.out / "progress.txt").open("a")

    def say(line: str) -> None:
        progress.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        progress.flush()
        print(line, flush=True)

    from uniprefill.testing.word_llama import prompts, write_qwen3_next_folder

    write_qwen3_next_folder(args.model_dir, ["linear_attention", "full_attention"] * 2)
    settings = json.loads(args.settings)
    say(f"model folder written; settings {settings}")
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.runner_hook import collect_drop_totals

    start = time.perf_counter()
    llm = LLM(model=str(args.model_dir), load_format="dummy", max_model_len=8192, seed=0,
              compilation_config={"inductor_compile_config": {"uniprefill": settings}})
    started = time.perf_counter() - start
    say(f"engine up in {started:.1f} s")
    texts = prompts(args.prompts, args.words) + prompts(1, 40)
    start = time.perf_counter()
    outputs = llm.generate(texts, SamplingParams(max_tokens=8, temperature=0.0))
    generated = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    say(f"generated in {generated:.2f} s: {tokens}")
    totals = collect_drop_totals(llm)  # a list (one per worker), or why not as text
    say(f"drop totals: {totals}")
    (args.out / "gdn-smoke.json").write_text(json.dumps(
        {"settings": settings, "engine_start_s": started, "generate_s": generated, "words": args.words,
         "tokens": tokens, "drop_totals": totals}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
