"""Which host<->device synchronisations a vLLM engine's steps make, standard vLLM or with the uniprefill option
(GPU box; written 2026-12-07 to trace the decode gap after a drop that `vllm bench serve` showed, +2% per token on
an H100 in run aa, +5.5% TPOT p50 in z's one H200 engine, while the in-process profile of run ab saw the decode's
device time at standard's).

    python3 -P scripts/gpu/vllm/sync_check.py --model-dir /tmp/llama8b-shaped-32 --load-format dummy \\
        --length 28672 --decode-tokens 32 [--uniprefill '{"p": 0.95, "vllm_drop": true}'] --out $OUT/sync-X.json

Why synchronisations: vLLM's default asynchronous scheduling prepares step N + 1 on the host while the device runs
step N. A host wait for the device inside a step (a blocking device-to-host copy, `.item()`, `nonzero`, a pageable
host-to-device copy) ends that overlap: the step's host work then adds to the step's time instead of hiding behind
the previous step's kernels. vLLM has a debugging aid for exactly this, `VLLM_GPU_SYNC_CHECK=warn`: after the
engine's warm-up it runs every `execute_model` and `sample_tokens` of the worker under
`torch.cuda.set_sync_debug_mode("warn")`, so each synchronising CUDA call warns. This script sets it (a debugging
aid, env by vLLM's design), runs the engine in this process so the warnings reach it, and counts them by the
innermost Python frame of vLLM or uniprefill that made them ("site"), for one prefill alone and for the same prompt
prefilled again (from an emptied prefix cache) plus `--decode-tokens` greedy tokens: the difference is the decode's.
Everything else is vLLM's defaults, as `profile_prefill.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

SYNC_WARNING = "synchronizing CUDA operation"
OWN_CODE = ("/uniprefill/", "/vllm/")  # frames that name a site (uniprefill/vllm/... is uniprefill's)
NOT_A_SITE = ("/torch/", "/warnings.py")  # torch's own frames and the warnings machinery that reports the sync


def site_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of vLLM or uniprefill in `stack` (outermost first), as `package/path.py:line function`
    (the path after the package folder's last occurrence, so a checkout or environment under a folder of that name
    does not count); else the innermost frame that is not torch's or the warnings module's, else the innermost."""
    frames = [(frame, frame.filename.replace(os.sep, "/")) for frame in reversed(stack)]
    for frame, path in frames:
        if any(part in path for part in NOT_A_SITE):
            continue
        for marker in OWN_CODE:
            if marker in path:
                return f"{marker.strip('/')}/{path.rsplit(marker, 1)[1]}:{frame.lineno} {frame.name}"
    for frame, path in frames:
        if not any(part in path for part in NOT_A_SITE):
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return f"{stack[-1].filename}:{stack[-1].lineno} {stack[-1].name}" if stack else "?"


class SyncRecorder:
    """Counts the sync-debug warnings by site while `phase` names what runs; other warnings pass through."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.counts: dict[str, Counter] = {}
        self._caught = None

    def __enter__(self) -> SyncRecorder:
        self._caught = warnings.catch_warnings()  # restores the filters and `showwarning` on exit
        self._caught.__enter__()
        show_other = warnings.showwarning
        warnings.simplefilter("always")  # every sync, not the first per location

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                site = site_of(traceback.extract_stack()[:-1])
                self.counts.setdefault(self.phase, Counter())[site] += 1
            else:
                show_other(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc) -> None:
        self._caught.__exit__(*exc)

    def table(self, phase: str) -> list:
        return [[site, n] for site, n in self.counts.get(phase, Counter()).most_common()]


def decode_only(with_decode: list, prefill: list) -> list:
    """Per site, the syncs of the prefill + decode run less those of the prefill-only run (positive only)."""
    before = dict((site, n) for site, n in prefill)
    rows = [[site, n - before.get(site, 0)] for site, n in with_decode if n > before.get(site, 0)]
    return sorted(rows, key=lambda row: -row[1])


def count_syncs(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its warnings reach us
    os.environ["VLLM_GPU_SYNC_CHECK"] = "warn"
    from vllm import LLM, SamplingParams

    from uniprefill.vllm.measure import token_prompts

    kwargs: dict = {"seed": 0, "max_model_len": args.max_model_len}
    if args.load_format:
        kwargs["load_format"] = args.load_format
    if args.uniprefill:
        kwargs["compilation_config"] = {"inductor_compile_config": {"uniprefill": json.loads(args.uniprefill)}}
    with SyncRecorder() as recorder:
        llm = LLM(model=str(args.model_dir), tokenizer=str(args.model_dir), **kwargs)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        decode = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)
        recorder.phase = "warm-up"
        llm.generate([{"prompt_token_ids": ids} for ids in token_prompts(args.length, 1, "warm", vocab)], decode,
                     use_tqdm=False)
        prompt = [{"prompt_token_ids": ids} for ids in token_prompts(args.length, 1, "checked", vocab)]
        tokens = {}
        for phase, params in (("prefill", prefill), ("prefill+decode", decode)):
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
            recorder.phase = phase
            tokens[phase] = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        recorder.phase = "teardown"
    out = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "syncs": {phase: recorder.table(phase) for phase in ("setup", "warm-up", "prefill", "prefill+decode")},
           "decode_token_ids": tokens["prefill+decode"]}
    out["syncs"]["decode_only"] = decode_only(out["syncs"]["prefill+decode"], out["syncs"]["prefill"])
    out["decode_syncs_per_token"] = round(sum(n for _, n in out["syncs"]["decode_only"]) / args.decode_tokens, 3)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--length", type=int, default=28672)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--uniprefill", default=None, help="JSON of the uniprefill settings (the one option)")
    parser.add_argument("--load-format", default=None, help="vLLM's load_format (dummy: a folder without weights)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.decode_tokens < 1:
        parser.error("--decode-tokens must be >= 1")
    result = count_syncs(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for phase in ("prefill", "decode_only"):
        print(f"{phase}: {sum(n for _, n in result['syncs'][phase])} syncs", file=sys.stdout)
        for site, n in result["syncs"][phase][:12]:
            print(f"  {n:6d}  {site}")
    print(f"decode syncs per token: {result['decode_syncs_per_token']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
