"""Run task samples through systems; one JSON line per (system, task, length, sample).

Resumable: results are appended to a JSON-lines file as they finish, and a restart skips
every (model, system, task, length, index, seed, haystack) already there. Shardable: the
prompts (task, length, index) are put in a fixed order and shard i/k takes every k-th; all
systems of a prompt run in the same shard, so baseline and method TTFTs of one prompt come
from the same device.

Per prompt and system: `warmup` untimed prefills, `repeats` timed ones (TTFT = their
median, device-synced), the drop report of the last prefill, then greedy generation
(stopping at a newline after some text when the task says so) and the task's score.

Timing every prompt is not needed for a TTFT estimate and triples the prefills, so
`timed_samples=k` times only the first k samples of each (task, length); the others are
generated (and scored) without a separate timed prefill, their drop report taken from the
generation's own prefill. `part` runs only the timed or only the untimed prompts: timed
ones alone on the device, untimed ones in several processes at once (their wall clock is
not reported, so sharing the device does not bias anything).

`stop_when_answered` ends a generation once its answer holds every reference: both
metrics only look for references in the text, and text only grows, so the score cannot
change after that point (`raw_output` is then shorter than the budget allows).
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from uniprefill.measure.environment import environment_info
from uniprefill.measure.timing import measure

from .haystack import load_essay_haystack
from .scoring import clean_prediction, score
from .systems import System, SystemSpec
from .tasks import Sample, check_task, make_sample, needs_essay


@dataclass(frozen=True)
class EvalPlan:
    """Which prompts to run.

    Attributes:
        tasks: task names.
        lengths: target lengths in tokens.
        num_samples: samples per (task, length).
        seed: seed of the samples.
        haystack: essay file for the essay tasks (None if no essay task is asked).
        max_new_tokens: answer budget for every task; each task's default when None.
    """

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    num_samples: int
    seed: int = 0
    haystack: str | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        for task in self.tasks:
            check_task(task)
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")
        essay_tasks = [t for t in self.tasks if needs_essay(t)]
        if essay_tasks and self.haystack is None:
            raise ValueError(f"tasks {essay_tasks} need an essay haystack file")

    def prompts(self) -> list[tuple[str, int, int]]:
        """(task, length, index) in the fixed order that shards split."""
        return [(t, n, i) for n in self.lengths for t in self.tasks
                for i in range(self.num_samples)]

    def haystack_name(self, task: str) -> str:
        spec = check_task(task)
        return os.path.basename(self.haystack) if spec.haystack == "essay" else spec.haystack


def parse_shard(text: str) -> tuple[int, int]:
    """"i/k" -> (i, k) with 0 <= i < k."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard {text!r} must look like i/k, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {text!r}: need 0 <= i < k")
    return index, count


def record_key(record: dict[str, Any]) -> tuple:
    return tuple(record[k] for k in
                 ("model", "system", "task", "length", "index", "seed", "haystack"))


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a results file (".gz": gzip-compressed); a torn last line is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{number}: unreadable line skipped", stacklevel=2)
    return records


class StopAtNewline:
    """A `StoppingCriteria`: stop once the new text has a newline after non-blank text."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:],
                                            skip_special_tokens=True)
        done = ["\n" in text.lstrip() for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class StopWhenAnswered:
    """A `StoppingCriteria`: stop once the answer so far scores 1 (every reference found)."""

    def __init__(self, tokenizer, prompt_len: int, sample: Sample):
        self.tokenizer, self.prompt_len, self.sample = tokenizer, prompt_len, sample

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:],
                                            skip_special_tokens=True)
        done = [score(self.sample.task, cut_answer(text, self.sample.stop_at_newline),
                      self.sample.answers) >= 1.0 for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_answer(text: str, stop_at_newline: bool) -> str:
    text = text.lstrip()
    if stop_at_newline:
        text = text.split("\n", 1)[0]
    return clean_prediction(text)


def run_eval(
    model,
    tokenizer,
    systems: Sequence[SystemSpec],
    plan: EvalPlan,
    out_path: str | os.PathLike,
    *,
    model_name: str,
    shard: tuple[int, int] = (0, 1),
    warmup: int = 1,
    repeats: int = 1,
    generate: bool = True,
    progress: bool = True,
    compile_backend: str = "inductor",
    settings: dict[str, Any] | None = None,
    timed_samples: int | None = None,
    part: str = "all",
    stop_when_answered: bool = True,
    decode_sdpa: str = "default",
    done_elsewhere: Sequence[str | os.PathLike] = (),
    measured_ideal: bool = False,
) -> list[dict[str, Any]]:
    """Run this shard's unfinished work items; append and return their records.

    Args:
        model, tokenizer: the model under test (already on its device) and its tokenizer.
        systems: the systems to compare; the same prompts go through each.
        model_name: recorded with every line and part of the resume key.
        shard: (i, k): run every k-th prompt starting at the i-th.
        warmup, repeats: untimed and timed prefills per prompt and system.
        generate: whether to generate and score, or only time the prefill.
        settings: extra settings recorded with every line (e.g. the command line).
        timed_samples: time only samples with index < this (None: all of them).
        part: "all", "timed" or "untimed": which of those prompts to run now.
        stop_when_answered: end a generation once every reference is in the answer.
        decode_sdpa: SDPA kernels of decode steps (`uniprefill.measure.sdpa`).
        done_elsewhere: other results files whose records count as done (e.g. an earlier
            session's merged results, while this run appends to a fresh file).
        measured_ideal: also measure each timed method prompt's ideal, the plain model timed
            on the kept token counts (`uniprefill.eval.ideal`), beside the FLOP-model one.
    """
    if part not in ("all", "timed", "untimed"):
        raise ValueError(f"part={part!r}: use 'all', 'timed' or 'untimed'")
    if timed_samples is not None and timed_samples < 0:
        raise ValueError(f"timed_samples={timed_samples} must be >= 0")
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    done = {record_key(r) for path in (out_path, *done_elsewhere) for r in read_records(path)}
    index, count = shard
    work = []

    def is_timed(i: int) -> bool:
        return timed_samples is None or i < timed_samples

    prompts = [(t, n, i) for t, n, i in plan.prompts()
               if part == "all" or is_timed(i) == (part == "timed")]
    for task, length, i in prompts[index::count]:
        for spec in systems:
            key = (model_name, spec.name, task, length, i, plan.seed, plan.haystack_name(task))
            if key not in done:
                work.append((task, length, i, spec, key))
    env = environment_info(device)
    essay = load_essay_haystack(plan.haystack) if plan.haystack else None
    bound: dict[str, System] = {}
    samples: dict[tuple[str, int, int], Sample] = {}
    ideal_times: dict[int, float] = {}  # the plain model's prefill seconds per token count, this prompt
    new_records = []
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(work), disable=not progress, desc="eval") as bar:
        for task, length, i, spec, key in work:
            bar.set_postfix_str(f"{spec.label} {task} {length}")
            sample = samples.get((task, length, i))
            if sample is None:
                samples.clear()  # one prompt at a time: all of its systems run together
                ideal_times.clear()
                sample = samples[(task, length, i)] = make_sample(
                    task, tokenizer, length, i, seed=plan.seed, haystack=essay,
                    max_new_tokens=plan.max_new_tokens)
            if spec.name not in bound:
                bound[spec.name] = System(spec, model, compile_backend=compile_backend)
            record = run_one(bound[spec.name], sample, tokenizer, device,
                             warmup=warmup, repeats=repeats, generate=generate,
                             timed=is_timed(i), stop_when_answered=stop_when_answered,
                             decode_sdpa=decode_sdpa, ideal_times=ideal_times if measured_ideal else None)
            record.update(key=list(key), model=model_name, env=env, settings=settings or {},
                          date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                              timespec="seconds"))
            out.write(json.dumps(record) + "\n")
            out.flush()
            new_records.append(record)
            bar.update(1)
    return new_records


def run_one(system: System, sample: Sample, tokenizer, device: torch.device, *,
            warmup: int = 1, repeats: int = 1, generate: bool = True, timed: bool = True,
            stop_when_answered: bool = True, decode_sdpa: str = "default",
            ideal_times: dict[int, float] | None = None) -> dict[str, Any]:
    """Time (if `timed`), report and (optionally) generate one sample with one system.

    `ideal_times` (a dict, shared by the systems of one prompt): also measure a timed
    method's ideal (`uniprefill.eval.ideal`: the plain model on the kept token counts).
    """
    if not timed and not generate:
        raise ValueError("an untimed prompt that is not generated would measure nothing")
    enc = tokenizer(sample.prompt, return_tensors="pt")
    ids = enc["input_ids"].to(device)
    mask = enc["attention_mask"].to(device)
    record: dict[str, Any] = {
        "system": system.spec.name,
        "system_label": system.spec.label,
        "system_spec": system.spec.as_dict(),
        "role": "baseline" if system.spec.is_baseline else "method",
        **{k: v for k, v in sample.to_dict().items() if k != "prompt"},
        "prompt_tokens": int(ids.shape[1]),
        "timed": timed,
        "ttft_s": None,
        "ttft": None,
        "first_token_id": None,
        "first_token": None,
        "drop_report": None,
        "overall_retention": None,
        "ideal_speedup": None,
        "prediction": None,
        "score": None,
        "generation": "skipped",
    }
    first_id = None
    if timed:
        begin = time.perf_counter()
        stats, logits = measure(lambda: system.prefill(ids, mask), device,
                                warmup=warmup, repeats=repeats)
        first_id = int(logits[0].argmax())
        record.update(ttft_s=stats.median_s, ttft=stats.as_dict(), first_token_id=first_id,
                      first_token=tokenizer.decode([first_id]),
                      prefills_wall_s=time.perf_counter() - begin)
        _add_drop_report(record, system)
        if ideal_times is not None and system.spec.config is not None:
            record["ideal_measured"] = _measured_ideal(system, ids, mask, record["drop_report"], device,
                                                       warmup, repeats, ideal_times)
    if not generate:
        return record
    pending = system.generation_pending
    if pending is not None:
        record.update(generation="pending", generation_error=pending)
        return record
    stopping = [StopAtNewline(tokenizer, ids.shape[1])] if sample.stop_at_newline else []
    if stop_when_answered:
        stopping.append(StopWhenAnswered(tokenizer, ids.shape[1], sample))
    begin = time.perf_counter()
    try:
        with torch.no_grad():
            new_ids = system.generate(
                ids, mask, max_new_tokens=sample.max_new_tokens, stopping_criteria=stopping,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id, decode_sdpa=decode_sdpa,
            )
    except Exception as err:  # noqa: BLE001 - the method's generate may not be ready yet
        if system.spec.config is None:  # the plain model, or a peer on it: its error is the answer
            raise
        record.update(generation="pending", generation_error=f"{type(err).__name__}: {err}")
        return record
    text = tokenizer.decode(new_ids[0], skip_special_tokens=True)
    prediction = cut_answer(text, sample.stop_at_newline)
    first_generated = int(new_ids[0, 0]) if new_ids.shape[1] else None
    record.update(
        prediction=prediction,
        raw_output=text,
        score=score(sample.task, prediction, sample.answers),
        generation="done",
        generate_wall_s=time.perf_counter() - begin,
        new_tokens=int(new_ids.shape[1]),
        stop_when_answered=stop_when_answered,
        decode_sdpa=decode_sdpa,
    )
    if timed:
        record["first_generated_matches_prefill"] = first_generated == first_id
    else:
        # the generation's own prefill: its drop report and first token stand for this prompt
        record.update(first_token_id=first_generated, first_token=None if first_generated is None
                      else tokenizer.decode([first_generated]))
        _add_drop_report(record, system)
    return record


def _measured_ideal(system: System, ids, mask, report, device, warmup: int, repeats: int,
                    times: dict[int, float]) -> dict[str, Any]:
    from .ideal import measured_ideal_of_report

    if system.spec.config.policy != "cumulative":
        return {"speedup": None, "reason": f"policy {system.spec.config.policy!r} is not modelled"}
    return measured_ideal_of_report(system.model, ids, mask, report, device, warmup=warmup,
                                    repeats=repeats, times=times)


def _add_drop_report(record: dict[str, Any], system: System) -> None:
    """The drop report of the system's last prefill, and the FLOP-model ideal speedup."""
    report = system.drop_report()
    record.update(drop_report=report,
                  overall_retention=report["overall_retention"] if report else None,
                  ideal_speedup=system.ideal_speedup(report, record["prompt_tokens"]))
