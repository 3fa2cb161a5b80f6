"""Smoke test of vLLM on the GPU box: `LLM(...).generate` on a Llama-shaped model with dummy weights.

    python3 scripts/gpu/vllm/smoke_llm.py --out $OUT/smoke-llama8b.json              # standard vLLM
    python3 scripts/gpu/vllm/smoke_llm.py --layers 4 --uniprefill --out $OUT/x.json  # the uniprefill channel

Offline: writes a Llama-3.1-8B-shaped config (hidden 4096, 32 layers, 32 heads, 8 KV heads,
MLP 14336, vocab 128256, llama3 RoPE scaling) and a word-level tokenizer built with
`tokenizers` into a folder, then loads it with `load_format="dummy"` (random weights: the
text is gibberish; the test is that the engine builds, compiles, captures CUDA graphs and
generates). "Standard vLLM" here is the default configuration (mode 3, CUDA graphs on).
`--uniprefill` uses the channel of docs/vllm.md (mode 2, backend
"uniprefill.vllm_plugin.vllm_backend"); until the vLLM graph adapter exists the backend runs
the graph unaccelerated and logs "running the vLLM graph unaccelerated" with the number of
attention ops it saw: that line is the check that vLLM handed over the whole backbone graph.
Run it from the repository root with scripts/gpu/vllm/env.sh sourced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "vocab_size": 128256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
WORDS = 2000


def write_model_folder(folder: Path, layers: int) -> None:
    """config.json plus a word-level tokenizer (ids 0-2 special, then "w0".."w1999")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA_8B, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def prompts(count: int, words: int) -> list[str]:
    return [" ".join(f"w{(i * 7919 + j * 104729) % WORDS}" for j in range(words)) for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--folder", type=Path, default=None, help="model folder (default /tmp/llama8b-shaped-<layers>)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--prompt-words", type=int, default=2000)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (no torch.compile, no CUDA graphs)")
    parser.add_argument("--uniprefill", action="store_true", help="the uniprefill channel (mode 2)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", type=Path, default=None, help="JSON summary path")
    args = parser.parse_args()

    folder = args.folder or Path(f"/tmp/llama8b-shaped-{args.layers}")
    write_model_folder(folder, args.layers)
    if args.uniprefill:
        # Mode 2 + vLLM's AOT compile needs a serialisable compiled function (docs/vllm.md);
        # set before vLLM reads its environment (the EngineCore subprocess inherits it).
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.uniprefill:
        kwargs["compilation_config"] = {
            "mode": 2,
            "backend": "uniprefill.vllm_plugin.vllm_backend",
            "inductor_compile_config": {"uniprefill": {"p": 0.99}},
        }
    summary = {
        "python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "layers": args.layers, "eager": args.eager, "uniprefill": args.uniprefill,
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE",
                                                "VLLM_USE_AOT_COMPILE")},
    }
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), tokenizer=str(folder), load_format="dummy", dtype="bfloat16",
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.eager, enable_flashinfer_autotune=False, seed=0, **kwargs)
    summary["engine_init_s"] = round(time.perf_counter() - t0, 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    texts = prompts(args.num_prompts, args.prompt_words)
    t0 = time.perf_counter()
    outputs = llm.generate(texts, params)
    summary["generate_s"] = round(time.perf_counter() - t0, 2)
    summary["prompt_tokens"] = [len(o.prompt_token_ids) for o in outputs]
    summary["output_token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    summary["ok"] = all(len(ids) == args.max_tokens for ids in summary["output_token_ids"])
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
