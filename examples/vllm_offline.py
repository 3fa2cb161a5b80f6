"""uniprefill inside vLLM 0.26.0: offline generation with token dropping, one request opted out.

    VLLM_USE_AOT_COMPILE=0 python examples/vllm_offline.py --model /path/to/hf-model-folder --p 0.95 [--decode-graphs]

Needs a GPU, vLLM 0.26.0 and uniprefill installed in the same environment (vLLM finds the
plugin through its `vllm.general_plugins` entry point). What the settings mean and why each is
needed: docs/vllm.md ("Switching it on"). Measured on an H200 (docs/benchmarks.md, "vLLM"):
2.07-2.42x standard vLLM's prefill throughput on a Llama-3.1-8B shape at keep 0.3; slower than
standard vLLM on a model as small as Gemma-3-270M. The same settings from the command line:

    VLLM_USE_AOT_COMPILE=0 vllm serve MODEL \\
        --no-enable-chunked-prefill --max-num-batched-tokens 32768 -cc '{"mode": 2, "backend": "uniprefill.vllm.plugin.vllm_backend",
        "inductor_compile_config": {"uniprefill": {"p": 0.95, "vllm_drop": true}}}'
"""
from __future__ import annotations

import argparse

from uniprefill import env
from uniprefill.vllm.engine_settings import dropping_engine_kwargs


def llm_kwargs(model: str, settings: dict, max_model_len: int = 32768, decode_graphs: bool = False) -> dict:
    """`vllm.LLM(**kwargs)` for a dropping engine (`uniprefill.vllm.engine_settings` says why each
    setting is needed); "vllm_drop" (the experimental rewrite; without it vLLM runs
    unaccelerated) is added to the `UniPrefillConfig` fields in `settings`."""
    return {"model": model, **dropping_engine_kwargs({"vllm_drop": True, **settings}, max_model_len=max_model_len,
                                                     decode_graphs=decode_graphs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face model folder")
    parser.add_argument("--p", type=float, default=0.95, help="share of the attention score to keep")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--decode-graphs", action="store_true", help="decode under CUDA graphs after drops")
    args = parser.parse_args()
    env.prepare_vllm_channel()  # no AOT compile in mode 2; collective_rpc(drop_totals) sends a function

    from vllm import LLM, SamplingParams

    from uniprefill.vllm.runner_hook import collect_drop_totals

    llm = LLM(**llm_kwargs(args.model, {"p": args.p}, args.max_model_len, args.decode_graphs))
    long_prompt = "Here is a long report. " + "The committee met and discussed the budget. " * 600
    prompts = [long_prompt + "\nQuestion: what did the committee discuss?\nAnswer:",
               long_prompt + "\nSummarise the report in one sentence:\n"]
    params = [SamplingParams(max_tokens=32, temperature=0.0),
              # this request keeps every row (per-request opt-out); {"p": 0.99} would give it its own p
              SamplingParams(max_tokens=32, temperature=0.0, extra_args={"uniprefill": False})]
    for output in llm.generate(prompts, params):
        print(f"{len(output.prompt_token_ids)} prompt tokens -> {output.outputs[0].text!r}")
    print("drop totals per worker:", collect_drop_totals(llm))


if __name__ == "__main__":
    main()
