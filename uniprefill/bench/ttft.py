"""Time to first token: the prefill of the plain model against uniprefill, over a sweep.

Each point (context length, batch size) is measured for the baseline (eager, `torch.compile`
with the default backend, or both: speedups are then taken against the FASTER one) and for
every (p, policy) of uniprefill, with warm-up runs, repeats, median/IQR/min/max, device sync
and peak memory (see `timing.measure`). Every uniprefill point also gets
- the analytic ideal speedup of `flops.flop_ratio` for the retention its drop report shows;
- the measured ideal, if an `ideal_fn(model, input_ids, attention_mask, report) -> seconds`
  is given (the same model run on tokens selected in advance, computed elsewhere).
Inputs are random token ids, or needle-in-a-haystack prompts when a tokenizer is given
(drop rates on random ids say little about real prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.eval.systems import System, baseline_spec, drop_points, peer_spec, uniprefill_spec

from uniprefill.measure.flops import prefill_flops
from uniprefill.measure.timing import measure

BASELINES = ("eager", "compiled", "both")
IdealFn = Callable[[Any, torch.Tensor, torch.Tensor, dict | None], float]


@dataclass(frozen=True)
class SweepPlan:
    """The points of a TTFT sweep.

    Attributes:
        lengths: context lengths in tokens.
        batch_sizes: sequences per prefill.
        configs: uniprefill settings to measure (one per p x policy, say).
        peers: peer accelerators to measure beside them (`uniprefill.peers.PeerSpec`).
        baseline: "eager", "compiled" (`torch.compile(model)`) or "both".
        warmup, repeats: untimed and timed runs per point.
        inputs: "random" token ids or "niah" prompts (needs a tokenizer).
        seed: seed of the inputs.
    """

    lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...] = (1,)
    configs: tuple[UniPrefillConfig, ...] = ()
    peers: tuple = ()
    baseline: str = "both"
    warmup: int = 2
    repeats: int = 5
    inputs: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline={self.baseline!r} is not one of {BASELINES}")
        if self.inputs not in ("random", "niah"):
            raise ValueError(f"inputs={self.inputs!r} is not 'random' or 'niah'")
        for name in ("lengths", "batch_sizes"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive integers")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"need repeats >= 1 and warmup >= 0; got {self.repeats}, {self.warmup}")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["configs"] = [c.to_dict() for c in self.configs]
        out["peers"] = [p.to_dict() for p in self.peers]
        return out


def make_inputs(kind: str, length: int, batch: int, *, vocab_size: int, device, seed: int = 0,
                tokenizer=None, haystack: str | None = None):
    """(input_ids, attention_mask) of `batch` rows near `length` tokens, left-padded."""
    if kind == "random":
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch, length), generator=gen)
        return ids.to(device), torch.ones_like(ids, device=device)
    if tokenizer is None:
        raise ValueError("inputs='niah' needs a tokenizer")
    from uniprefill.eval.tasks import make_sample

    task = "niah_single_2" if haystack else "niah_single_1"
    rows = [tokenizer(make_sample(task, tokenizer, length, i, seed=seed, haystack=haystack,
                                  max_new_tokens=0).prompt)["input_ids"] for i in range(batch)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids.to(device), mask.to(device)


def analytic_speedup(config, report: dict | None, row_lengths: Sequence[int],
                     policy: str, last_q: int) -> float | None:
    """Baseline / dropped FLOPs over the batch, from the per-row counts of a drop report."""
    points = drop_points(report)
    if not points:
        return None
    layers = [p["layer"] for p in points]
    base = dropped = 0.0
    for row, n in enumerate(row_lengths):
        retention = [p["kept"][row] / max(p["entering"][row], 1) if "kept" in p
                     else p["retention"] for p in points]
        base += prefill_flops(config, n)
        dropped += prefill_flops(config, n, retention, layers, policy=policy, last_q=last_q)
    return base / dropped


def sweep(model, plan: SweepPlan, *, model_name: str, tokenizer=None, haystack=None,
          ideal_fn: IdealFn | None = None, compile_backend: str = "inductor",
          progress: bool = True) -> list[dict[str, Any]]:
    """Measure every point of `plan`; one result dict per (length, batch, system)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    specs = []
    if plan.baseline in ("eager", "both"):
        specs.append(baseline_spec(compiled=False))
    if plan.baseline in ("compiled", "both"):
        specs.append(baseline_spec(compiled=True))
    specs += [uniprefill_spec(c) for c in plan.configs]
    specs += [peer_spec(p) for p in plan.peers]
    bound: dict[str, System] = {}
    results = []
    points = [(n, b) for n in plan.lengths for b in plan.batch_sizes]
    bar = tqdm(total=len(points) * len(specs), disable=not progress, desc="bench")
    for length, batch in points:
        ids, mask = make_inputs(plan.inputs, length, batch, vocab_size=model.config.vocab_size,
                                device=device, seed=plan.seed, tokenizer=tokenizer,
                                haystack=haystack)
        row_lengths = mask.sum(dim=1).tolist()
        at_point = []
        for spec in specs:
            bar.set_postfix_str(f"{spec.label} {length}x{batch}")
            if spec.name not in bound:
                bound[spec.name] = System(spec, model, compile_backend=compile_backend)
            system = bound[spec.name]
            stats, _ = measure(lambda: system.prefill(ids, mask), device,
                               warmup=plan.warmup, repeats=plan.repeats)
            report = system.drop_report()
            result = {
                "model": model_name, "length": length, "batch": batch,
                "tokens": int(mask.sum()), "system": spec.name, "label": spec.label,
                "role": "baseline" if spec.is_baseline else "method",
                "config": spec.config.to_dict() if spec.config else None,
                "ttft": stats.as_dict(), "ttft_ms": 1000 * stats.median_s, "peer": spec.peer.to_dict() if spec.peer else None,
                "drop_report": report,
                "overall_retention": report["overall_retention"] if report else None,
                "density": report.get("density") if report and spec.peer is not None else None,
            }
            if spec.config is not None:
                result["analytic_ideal_speedup"] = analytic_speedup(
                    model.config, report, row_lengths, spec.config.policy, spec.config.last_q)
                if ideal_fn is not None:
                    result["ideal_ttft_s"] = float(ideal_fn(model, ids, mask, report))
            at_point.append(result)
            bar.update(1)
        _add_speedups(at_point)
        results += at_point
    bar.close()
    return results


def _add_speedups(at_point: list[dict[str, Any]]) -> None:
    baselines = [r for r in at_point if r["role"] == "baseline"]
    if not baselines:
        return
    best = min(baselines, key=lambda r: r["ttft"]["median_s"])
    for r in at_point:
        r["baseline_ms"] = best["ttft_ms"]
        r["baseline_system"] = best["system"]
        r["speedup"] = best["ttft"]["median_s"] / r["ttft"]["median_s"]
        if "ideal_ttft_s" in r:
            r["ideal_speedup"] = best["ttft"]["median_s"] / r["ideal_ttft_s"]


def format_results(results: Sequence[dict[str, Any]]) -> str:
    header = ("length", "batch", "system", "TTFT ms (median)", "IQR ms", "peak GiB",
              "speedup", "ideal (FLOPs)", "ideal (meas.)", "retention")
    lines = []
    for r in results:
        t = r["ttft"]
        peak = t["peak_memory_bytes"]
        ideal = r.get("analytic_ideal_speedup")
        lines.append((
            str(r["length"]), str(r["batch"]), r["label"], f"{r['ttft_ms']:.2f}",
            f"{1000 * t['q1_s']:.2f}-{1000 * t['q3_s']:.2f}",
            f"{peak / 2**30:.2f}" if peak is not None else "",
            f"{r['speedup']:.2f}x" if "speedup" in r else "",
            f"{ideal:.2f}x" if ideal is not None else "",
            f"{r['ideal_speedup']:.2f}x" if "ideal_speedup" in r else "",
            _retention_cell(r),
        ))
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*x) for x in lines])


def _retention_cell(r: dict[str, Any]) -> str:
    """Retention at the last drop point; a peer's attention density; the mean block density of
    the sparse layers before the first drop (config.early_sparse_*) when there are some."""
    cell = (f"{r['overall_retention']:.3f}" if r["overall_retention"] is not None else
            (f"density {r['density']:.3f}" if r.get("density") is not None else ""))
    sparse = (r.get("drop_report") or {}).get("sparse_density")
    if sparse:
        cell += f", sparse density {sum(sparse.values()) / len(sparse):.3f}"
    return cell


def plot_sweep(results: Sequence[dict[str, Any]], path: str) -> None:
    """TTFT vs length and speedup vs length (batch = the smallest measured), to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = min(r["batch"] for r in results)
    rows = [r for r in results if r["batch"] == batch]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in labels:
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["length"])
        xs = [r["length"] for r in mine]
        ax_t.plot(xs, [r["ttft_ms"] for r in mine], marker="o", label=label)
        if mine[0]["role"] == "method":
            line, = ax_s.plot(xs, [r["speedup"] for r in mine], marker="o", label=label)
            ideal = [(r["length"], r.get("analytic_ideal_speedup")) for r in mine]
            ideal = [(x, y) for x, y in ideal if y is not None]
            if ideal:
                ax_s.plot(*zip(*ideal), linestyle="--", color=line.get_color(),
                          label=f"{label} (ideal, FLOPs)")
    ax_t.set(xscale="log", yscale="log", xlabel="context length (tokens)",
             ylabel="TTFT (ms, median)", title=f"TTFT, batch {batch}")
    ax_s.axhline(1.0, color="gray", linewidth=0.8)
    ax_s.set(xscale="log", xlabel="context length (tokens)",
             ylabel="speedup over the faster baseline (x)", title="Speedup")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
