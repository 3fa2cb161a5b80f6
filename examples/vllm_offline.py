"""uniprefill inside vLLM 0.26.0: offline generation with token dropping, one request opted out.

    python examples/vllm_offline.py --model /path/to/hf-model-folder --p 0.95

Needs a GPU, vLLM 0.26.0 and uniprefill installed in the same environment (vLLM finds the
plugin through its `vllm.general_plugins` entry point). The uniprefill settings are the one
option; every other engine setting is vLLM's default (compilation mode 3 with Inductor and CUDA
graphs, chunked prefill, prefix caching). docs/vllm.md says what runs accelerated. Measured on an
H200 under these defaults (docs/results/vllm-defaults-h200-2026-12-03): 2.06-2.25x standard vLLM's
prefill throughput on a Llama-3.1-8B shape at keep 0.3 (8K and 16K prompts). The same from the
command line:

    vllm serve MODEL -cc '{"inductor_compile_config": {"uniprefill": {"p": 0.95, "vllm_drop": true}}}'
"""
from __future__ import annotations

import argparse

from uniprefill.vllm.engine_settings import dropping_engine_kwargs


def llm_kwargs(model: str, settings: dict, max_model_len: int = 32768) -> dict:
    """`vllm.LLM(**kwargs)` for a dropping engine on vLLM's defaults; "vllm_drop" (the rewrite;
    without it vLLM runs unaccelerated) is added to the `UniPrefillConfig` fields in `settings`."""
    return {"model": model, **dropping_engine_kwargs({"vllm_drop": True, **settings}, max_model_len=max_model_len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face model folder")
    parser.add_argument("--p", type=float, default=0.95, help="share of the attention score to keep")
    parser.add_argument("--max-model-len", type=int, default=32768)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.runner_hook import collect_drop_totals

    llm = LLM(**llm_kwargs(args.model, {"p": args.p}, args.max_model_len))
    long_prompt = "Here is a long report. " + "The committee met and discussed the budget. " * 600
    prompts = [long_prompt + "\nQuestion: what did the committee discuss?\nAnswer:",
               long_prompt + "\nSummarise the report in one sentence:\n"]
    params = [SamplingParams(max_tokens=32, temperature=0.0),
              # this request keeps every row (per-request opt-out); {"p": 0.99} would give it its own p
              SamplingParams(max_tokens=32, temperature=0.0, extra_args={"uniprefill": False})]
    for output in llm.generate(prompts, params):
        print(f"{len(output.prompt_token_ids)} prompt tokens -> {output.outputs[0].text!r}")
    # by name: the plugin gave vLLM's worker the method `uniprefill_drop_totals` (no function sent)
    print("drop totals per worker:", collect_drop_totals(llm))


if __name__ == "__main__":
    main()
