"""The systems an evaluation compares: the plain model, the model under uniprefill, and peers.

A `SystemSpec` names a system and holds its settings; `System` is the spec bound to a model,
ready to prefill (what TTFT measures) and to generate greedily. The uniprefill system is
`uniprefill.compile(model, config)`; generation goes through `compiled.generate`, and when
that is missing or would just run the original model, the system says so
(`generation_pending`) instead of quietly scoring the unaccelerated model. A peer system
(`uniprefill.peers`: FlexPrefill, XAttention, MInference) runs the plain model with the peer's
prefill attention switched in for each call; its "drop report" is the peer's counts (calls it
served, their attention density, the SDPA calls and why).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from uniprefill.config import UniPrefillConfig


@dataclass(frozen=True)
class SystemSpec:
    """What runs the prompts.

    Attributes:
        name: stable key of the system in result files ("baseline", "baseline-compiled",
            "uniprefill-<config hash>").
        label: short readable description for tables and plots.
        config: the uniprefill settings, or None for the plain model.
        compiled: for the plain model, whether it runs under `torch.compile`.
        peer: a peer accelerator (`uniprefill.peers.PeerSpec`) run on the plain model.
    """

    name: str
    label: str
    config: UniPrefillConfig | None = None
    compiled: bool = False
    peer: Any = None

    @property
    def is_baseline(self) -> bool:
        return self.config is None and self.peer is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "config": self.config.to_dict() if self.config is not None else None,
            "compiled": self.compiled,
            "peer": self.peer.to_dict() if self.peer is not None else None,
        }


def baseline_spec(compiled: bool = False) -> SystemSpec:
    name = "baseline-compiled" if compiled else "baseline"
    return SystemSpec(name, name, None, compiled)


def uniprefill_spec(config: UniPrefillConfig) -> SystemSpec:
    drop = config.drop_layers if isinstance(config.drop_layers, str) else ",".join(
        map(str, config.drop_layers))
    if config.keep_ratio is None:
        label = f"uniprefill p={config.p:g} {config.policy} drop={drop}"
    else:  # forced retention: p plays no part
        label = f"uniprefill keep={','.join(f'{r:g}' for r in config.keep_ratio)} {config.policy} drop={drop}"
    if config.selection != "paper":
        label += f" selection={config.selection}"
    if config.window_positions != "original":
        label += f" window={config.window_positions}"
    if config.early_sparse:
        rule = (f"p={config.early_sparse_p:g}" if config.early_sparse_p is not None
                else f"keep={config.early_sparse_keep:g}")
        label += f" + early sparse {rule} band={config.early_sparse_window}"
    return SystemSpec(f"uniprefill-{config.stable_hash()}", label, config, True)


def peer_spec(peer) -> SystemSpec:
    """The system of a peer accelerator (`uniprefill.peers.PeerSpec`)."""
    return SystemSpec(f"peer-{peer.method}-{peer.stable_hash()}", peer.label, None, False, peer)


def uniprefill_api():
    """The `uniprefill` module, or `RuntimeError` if `compile` is not there yet."""
    import uniprefill

    missing = [n for n in ("compile", "last_drop_report") if not hasattr(uniprefill, n)]
    if missing:
        raise RuntimeError(f"uniprefill.{' and uniprefill.'.join(missing)} not available yet")
    return uniprefill


class System:
    """A `SystemSpec` bound to a model."""

    def __init__(self, spec: SystemSpec, model, *, compile_backend: str = "inductor"):
        self.spec = spec
        self.model = model
        self._peer = None
        if spec.peer is not None:
            from uniprefill.peers.attention import PeerAttention

            self._api = None
            self._peer = PeerAttention(spec.peer)
            self.fn = model
        elif spec.config is not None:
            self._api = uniprefill_api()
            self.fn = self._api.compile(model, spec.config)
        elif spec.compiled:
            self._api = None
            self.fn = torch.compile(model, backend=compile_backend)
        else:
            self._api = None
            self.fn = model

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits of the last position, [batch, vocab]: the work that TTFT measures."""
        with self._peer_applied():
            out = self.fn(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1
            )
        return out.logits[:, -1]

    def _peer_applied(self):
        if self._peer is None:
            return contextlib.nullcontext()
        self._peer.counts.reset()  # the counts describe the last call
        return self._peer.applied(self.model)

    def drop_report(self) -> dict[str, Any] | None:
        """The drop report of the last prefill (`as_dict()` plus `overall_retention`).

        For a peer: its counts of the last call (`PeerCounts.as_dict()`), with "density" the mean
        share of causal attention blocks its sparse calls computed; no retention (nothing dropped).
        """
        if self._peer is not None:
            return {**self._peer.counts.as_dict(), "overall_retention": None}
        if self._api is None:
            return None
        report = self._api.last_drop_report(self.fn)
        if report is None:
            # the compiled graph never ran (dynamo fell back to eager, e.g. at its recompile
            # limit): scoring this as the method would score the plain model
            raise RuntimeError(f"{self.spec.label}: the last prefill did not run through the "
                               "uniprefill graph (see the warning above); refusing to record it")
        data = _jsonable(report.as_dict())
        if not isinstance(data, dict):
            data = {"drop_points": data}
        data["overall_retention"] = float(report.overall_retention)
        return data

    def ideal_speedup(self, report: dict[str, Any] | None, seq_len: int) -> float | None:
        """FLOP-model ideal prefill speedup at the retentions of `report` (None: baseline).

        `uniprefill.measure.flops.flop_ratio` with the kept share of every drop point: what
        dropping would save if scoring, selection and gathers were free.
        """
        if self.spec.config is None:
            return None
        points = drop_points(report)
        if not points:
            return 1.0
        from uniprefill.measure.flops import flop_ratio

        return flop_ratio(self.model.config, seq_len, [float(p["retention"]) for p in points],
                          [int(p["layer"]) for p in points], policy=self.spec.config.policy,
                          last_q=self.spec.config.last_q)

    @property
    def generation_pending(self) -> str | None:
        """Why this system cannot generate yet, or None if it can."""
        if self.spec.config is None:
            return None
        generate = getattr(self.fn, "generate", None)
        if generate is None:
            return "the compiled model has no generate() yet"
        original = getattr(self.fn, "_orig_mod", None)
        if original is not None and getattr(generate, "__self__", None) is original:
            return "compiled.generate() is the original model's generate(): not accelerated"
        return None

    def generate(self, input_ids, attention_mask, *, max_new_tokens: int, stopping_criteria,
                 pad_token_id: int | None, eos_token_id: int | None,
                 decode_sdpa: str = "default") -> torch.Tensor:
        """Greedy continuation ids, [batch, new tokens].

        `decode_sdpa`: SDPA kernels of the decode steps (`uniprefill.measure.sdpa`); the
        prefill inside generation keeps the default kernels.
        """
        from transformers import GenerationConfig

        from uniprefill.measure.sdpa import for_decode_steps

        target = self.model if self.spec.config is None else self.fn
        peer_context = self._peer_applied()
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
        )
        # generation calls target(...), which looks `forward` up on the instance first
        object.__setattr__(target, "forward", for_decode_steps(target.forward, decode_sdpa))
        try:
            with peer_context:
                out = target.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                    stopping_criteria=stopping_criteria,
                )
        finally:
            object.__delattr__(target, "forward")
        return out[:, input_ids.shape[1]:]


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return value


def drop_points(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The per-drop-point entries of a `System.drop_report()`, in layer order."""
    if not report:
        return []
    points = report.get("drop_points") or []
    points = [p for p in points if isinstance(p, dict) and "layer" in p]
    return sorted(points, key=lambda p: p["layer"])
