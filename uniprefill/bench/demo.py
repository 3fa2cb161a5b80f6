"""The `uniprefill demo`: one needle-in-a-haystack prompt, baseline vs uniprefill.

Prints the TTFT of each, the speedup, the retention at each drop layer and whether each
system found the needle. When the compiled model cannot generate yet, the demo prints each
system's first-token prediction instead and marks generation as pending; it never borrows
the baseline's generation for the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from uniprefill.config import UniPrefillConfig
from uniprefill.eval.runner import run_one
from uniprefill.eval.systems import System, baseline_spec, drop_points, uniprefill_spec
from uniprefill.eval.tasks import Sample, make_sample


@dataclass(frozen=True)
class DemoSettings:
    length: int = 3000
    seed: int = 0
    warmup: int = 1
    repeats: int = 2
    index: int = 1  # needle depth 1/2: the middle of the haystack


def demo_sample(tokenizer, settings: DemoSettings, haystack: str | None) -> Sample:
    task = "niah_single_2" if haystack else "niah_single_1"
    return make_sample(task, tokenizer, settings.length, settings.index, seed=settings.seed,
                       haystack=haystack)


def run_demo(model, tokenizer, config: UniPrefillConfig, sample: Sample,
             settings: DemoSettings, *, log=print) -> dict[str, Any]:
    """Run both systems on `sample`; returns the two records (see `runner.run_one`)."""
    device = next(model.parameters()).device
    records = {}
    for spec in (baseline_spec(), uniprefill_spec(config)):
        log(f"running {spec.label}: {settings.warmup} warm-up prefill(s) (the first one compiles), "
            f"{settings.repeats} timed, then the answer ...")
        system = System(spec, model)
        records[spec.name if spec.is_baseline else "uniprefill"] = run_one(
            system, sample, tokenizer, device, warmup=settings.warmup, repeats=settings.repeats)
    return records


def format_demo(sample: Sample, records: dict[str, Any]) -> str:
    base, method = records["baseline"], records["uniprefill"]
    width = max(len("system"), len(base["system_label"]), len(method["system_label"]))
    lines = [
        f"prompt: {sample.task}, {sample.num_tokens} tokens, needle at depth {sample.depth:.2f}, "
        f"answer {sample.answers[0]}",
        "",
        f"{'system':<{width}} {'TTFT ms':>9}  first token  answer",
    ]
    for rec in (base, method):
        if rec["generation"] == "done":
            verdict = f"{'correct' if rec['score'] == 1.0 else 'WRONG'}: {rec['prediction']!r}"
        else:
            verdict = f"generation pending ({rec.get('generation_error', '')})"
        lines.append(f"{rec['system_label']:<{width}} {1000 * rec['ttft_s']:>9.1f}  "
                     f"{rec['first_token']!r:<11}  {verdict}")
    lines.append("")
    lines.append(f"speedup: {base['ttft_s'] / method['ttft_s']:.2f}x (median of "
                 f"{len(base['ttft']['times_s'])} timed prefills each)")
    points = drop_points(method["drop_report"])
    if points:
        for p in points:
            lines.append(f"  drop at layer {p['layer']:>3}: kept {sum(p['kept']):>6} of "
                         f"{sum(p['entering']):>6} tokens ({p['retention']:.1%})")
        lines.append(f"  overall retention: {method['overall_retention']:.1%}")
    else:
        lines.append("  no tokens were dropped (no drop report)")
    same = base["first_token_id"] == method["first_token_id"]
    lines.append(f"first-token predictions {'agree' if same else 'DIFFER'}")
    return "\n".join(lines)
