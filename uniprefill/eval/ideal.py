"""The measured ideal speedup of a dropped prefill.

The backend issue defines the ideal of a prefill with drop points as the same model run on
the same kept tokens selected in advance: no scoring, no selection, no gathers. Like
`benchmarks/bench_backend_ttft.py`, it is measured per layer segment: the plain model is
timed on prompts of each segment's token count, and each time is weighted by the share of
the layers that run on that many tokens,

    ideal = t(N) * (l_1 + 0.5) / L + t(K_1) * (l_2 - l_1) / L + ... + t(K_m) * (L - l_m - 0.5) / L

where drop point i sits after layer l_i's attention (its MLP already runs on the K_i kept
tokens, hence the halves), and t(n) is the plain model's prefill of the prompt's last n
tokens. Unlike the FLOP-model ideal (`uniprefill.measure.flops`), it pays what the plain model
pays at each size, launch overheads included, so it is the fair bar where a small model is
host-bound after a drop. It weights layers by count, so it is an estimate where layers differ
in cost (Gemma-3's full-attention layers cost more than its sliding ones at long N).
Only the cumulative policy (each drop point keeps a subset of the last) is modelled.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from uniprefill.measure.timing import measure


def layer_segments(num_layers: int, points: list[tuple[int, int]], seq_len: int) -> list[tuple[int, float]]:
    """(tokens, share of the layers) per segment, for drop points [(layer, kept tokens), ...]."""
    if not points:
        return [(seq_len, 1.0)]
    points = sorted(points)
    layers = [layer for layer, _ in points]
    if layers[0] < 0 or layers[-1] >= num_layers or len(set(layers)) != len(layers):
        raise ValueError(f"drop layers {layers} must be distinct and inside 0..{num_layers - 1}")
    bounds = [0.0] + [layer + 0.5 for layer in layers] + [float(num_layers)]
    tokens = [seq_len] + [kept for _, kept in points]
    return [(n, (hi - lo) / num_layers) for n, lo, hi in zip(tokens, bounds, bounds[1:])]


def measured_ideal(prefill: Callable[[torch.Tensor, torch.Tensor], Any], ids: torch.Tensor,
                   mask: torch.Tensor, segments: list[tuple[int, float]], device: torch.device, *,
                   warmup: int = 1, repeats: int = 1,
                   times: dict[int, float] | None = None) -> dict[str, Any]:
    """Time the plain model's `prefill` on the last n tokens of the prompt for every segment.

    `times` caches seconds per token count across calls for the same prompt (e.g. the
    systems of one prompt share t(N)). Returns the segments with their times, the plain
    prefill's time on the whole prompt and the ideal speedup t(N) / ideal.
    """
    times = {} if times is None else times
    for n in {ids.shape[1], *(n for n, _ in segments)}:
        if n not in times:
            n_ids, n_mask = ids[:, ids.shape[1] - n:], mask[:, mask.shape[1] - n:]
            stats, _ = measure(lambda: prefill(n_ids, n_mask), device, warmup=warmup, repeats=repeats)
            times[n] = stats.median_s
    ideal_s = sum(share * times[n] for n, share in segments)
    return {
        "segments": [[n, share, times[n]] for n, share in segments],
        "base_s": times[ids.shape[1]],
        "ideal_s": ideal_s,
        "speedup": times[ids.shape[1]] / ideal_s,
    }


def measured_ideal_of_report(model, ids: torch.Tensor, mask: torch.Tensor, report: dict[str, Any] | None,
                             device: torch.device, *, warmup: int = 1, repeats: int = 1,
                             times: dict[int, float] | None = None) -> dict[str, Any]:
    """`measured_ideal` for one row prefilled by `model` under uniprefill with drop report
    `report` (a `DropHistory.as_dict()`); the plain model is `model` itself."""
    from .systems import drop_points

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    points = [(int(p["layer"]), int(p["kept"][0])) for p in drop_points(report)]
    segments = layer_segments(config.num_hidden_layers, points, int(ids.shape[1]))

    def plain(i, m):
        return model(input_ids=i, attention_mask=m, use_cache=False, logits_to_keep=1).logits

    return measured_ideal(plain, ids, mask, segments, device, warmup=warmup, repeats=repeats, times=times)
