"""One vLLM engine of a small Qwen3-Next (dummy weights) on vLLM's defaults plus the uniprefill option: do its
Gated DeltaNet layers after a drop point run on the kept rows (`uniprefill/vllm/gdn_metadata.py`) in real vLLM?

    source scripts/gpu/vllm/env.sh && bash scripts/gpu/vllm/box_refresh_uniprefill.sh
    python3 -P scripts/gpu/vllm/gdn_smoke.py --out $OUT/gdn [--settings JSON | --standard] [--words 3000] [--prompts 4]

--standard runs the same engine without uniprefill (writes gdn-standard.json): with `--settings '{"p": 1.0,
"vllm_drop": true, "drop_layers": [1], "impl": "torch"}'` beside it, the two token lists must be equal
(`--compare A.json B.json` prints per prompt whether they are).

Layers linear, full, linear, full (`word_llama.write_qwen3_next_folder`), the drop after layer 1, so the GDN
layer 2 and the attention layer 3 run on the kept rows. `--prompts` prompts of up to `--words` words (tokens, mixed
lengths) and one short one,
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
    parser.add_argument("--out", type=Path)
    parser.add_argument("--settings", default='{"keep_ratio": 0.3, "drop_layers": [1], "vllm_drop": true, '
                                              '"impl": "torch"}')
    parser.add_argument("--words", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-next-tiny"))
    parser.add_argument("--standard", action="store_true", help="no uniprefill option (the reference engine)")
    parser.add_argument("--name", default=None, help="the result file's stem (default gdn-smoke / gdn-standard)")
    parser.add_argument("--compare", nargs=2, type=Path, default=None, help="compare two result files and exit")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out is required (except with --compare)")
    args.out.mkdir(parents=True, exist_ok=True)
    progress = (args.out / "progress.txt").open("a")

    def say(line: str) -> None:
        progress.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        progress.flush()
        print(line, flush=True)

    from uniprefill.testing.word_llama import prompts, write_qwen3_next_folder

    write_qwen3_next_folder(args.model_dir, ["linear_attention", "full_attention"] * 2)
    settings = None if args.standard else json.loads(args.settings)
    say(f"model folder written; settings {settings}")
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.runner_hook import collect_drop_totals

    start = time.perf_counter()
    option = {} if settings is None else {"compilation_config": {"inductor_compile_config": {"uniprefill": settings}}}
    llm = LLM(model=str(args.model_dir), load_format="dummy", max_model_len=8192, seed=0, **option)
    started = time.perf_counter() - start
    say(f"engine up in {started:.1f} s")
    # mixed lengths: prompt i has words * (i + 1) / prompts words (distinct texts), then one short prompt
    texts = [prompts(i + 1, max(64, args.words * (i + 1) // args.prompts))[i] for i in range(args.prompts)]
    texts += prompts(1, 40)
    start = time.perf_counter()
    outputs = llm.generate(texts, SamplingParams(max_tokens=8, temperature=0.0))
    generated = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    say(f"generated in {generated:.2f} s: {tokens}")
    totals = collect_drop_totals(llm) if settings is not None else None  # one per worker, or why not as text
    say(f"drop totals: {totals}")
    name = args.name or ("gdn-standard" if settings is None else "gdn-smoke")
    (args.out / f"{name}.json").write_text(json.dumps(
        {"settings": settings, "engine_start_s": started, "generate_s": generated, "words": args.words,
         "tokens": tokens, "drop_totals": totals}, indent=1, default=str))
    return 0


def compare(a: Path, b: Path) -> int:
    """Per prompt, whether two runs' greedy tokens are equal; exit status 1 if any differ."""
    ta, tb = (json.loads(path.read_text())["tokens"] for path in (a, b))
    equal = [x == y for x, y in zip(ta, tb)]
    print(json.dumps({"prompts": len(equal), "identical": sum(equal), "equal_per_prompt": equal}))
    return 0 if all(equal) and len(ta) == len(tb) else 1


if __name__ == "__main__":
    raise SystemExit(main())
