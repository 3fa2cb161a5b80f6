"""Drop history: which tokens each drop point kept, for one forward call.

Plain Python and tensors only (no Hugging Face types), so the vLLM integration can use the
same structures. A `DropRecorder` belongs to one compiled model (no global state); the
rewritten graph's recorder ops (`record_ops`) call `begin` once per forward and `record` at
every drop point with the per-row token counts (host tensors, so recording never synchronises
the device), on the recorder `recording_into` made current for that call (a context variable,
set and reset around each call: the ops take no Python object).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DropPoint:
    layer: int
    entering: tuple[int, ...]  # tokens per row entering the drop point
    kept: tuple[int, ...]  # tokens per row kept
    kept_flat: torch.Tensor | None = None  # flat b * N + t index of every kept token (device)

    def kept_positions(self, row: int, seq_len: int) -> torch.Tensor:
        """Original token positions (column in the padded prompt) kept in `row`."""
        flat = self.kept_flat
        return flat[(flat // seq_len) == row] % seq_len

    @property
    def retention(self) -> float:
        total = sum(self.entering)
        return sum(self.kept) / total if total else 1.0


@dataclass
class DropHistory:
    rows: int
    seq_len: int
    points: list[DropPoint] = field(default_factory=list)
    policy: str = "cumulative"
    decoded: int = 0  # tokens decoded after this prefill
    # ORIGINAL positions of padding tokens in row 0 (None: none): layers before the first
    # drop cache them, and decode steps must not attend to them
    pad_positions: torch.Tensor | None = None
    _positions: dict = field(default_factory=dict, repr=False, compare=False)  # memo of layer_positions
    # config.early_sparse_*: layer -> block density of its sparse attention (0-d device tensor,
    # read only when asked, so recording never synchronises the device)
    sparse: dict = field(default_factory=dict)
    # layer -> (softcap, upcast, has sinks) of the eager attention (`sink_ops`) the prefill ran
    # there; a layer not in it ran SDPA. Decode steps after the prefill compute the same form.
    attention: dict = field(default_factory=dict)
    # layers whose prefill added a per-key bias (ALiBi, `sink_ops` key_bias): decode does not model it
    key_bias_layers: set = field(default_factory=set)

    def sparse_density(self) -> dict[int, float]:
        """Block density of each sparse attention layer of this prefill (1.0: it ran dense)."""
        return {layer: float(d) for layer, d in self.sparse.items()}

    def layer_positions(self, layer: int, row: int = 0) -> torch.Tensor:
        """ORIGINAL prompt positions whose key/value the cache of `layer` holds after the prefill.

        A layer runs on the tokens kept by the last drop point before it; a drop layer's own
        attention runs before its drop. Under "suspend", a later drop layer runs on all tokens.
        """
        key = (layer, row, len(self.points))
        if key not in self._positions:
            earlier = [p for p in self.points if p.layer < layer]
            is_drop = any(p.layer == layer for p in self.points)
            if not earlier or (self.policy == "suspend" and is_drop):
                self._positions[key] = torch.arange(self.seq_len)
            else:
                self._positions[key] = earlier[-1].kept_positions(row, self.seq_len).cpu()
        return self._positions[key]

    def key_positions(self, layer: int, cached: int) -> torch.Tensor:
        """Positions of the `cached` keys a decode step of `layer` attends to (row 0).

        The cache holds the layer's prompt positions, then one entry per decoded token; a
        sliding-window cache keeps only the most recent entries, hence the last `cached`
        (built from those alone: a decode step must not copy the whole prompt's positions).
        """
        base = self.layer_positions(layer)
        if cached > base.numel() + self.decoded:
            raise RuntimeError(
                f"layer {layer} holds {cached} cached keys but the drop history of the last prefill "
                f"accounts for {base.numel() + self.decoded}: this cache does not belong to that prefill"
            )
        from_prompt = max(0, cached - self.decoded)
        decoded = torch.arange(self.seq_len + self.decoded - (cached - from_prompt), self.seq_len + self.decoded)
        if from_prompt == 0:
            return decoded
        return torch.cat([base[base.numel() - from_prompt:], decoded])

    @property
    def overall_retention(self) -> float:
        """Kept share at the last drop point, relative to the prompt's real tokens."""
        if not self.points:
            return 1.0
        first = sum(self.points[0].entering)
        return sum(self.points[-1].kept) / first if first else 1.0

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "seq_len": self.seq_len,
            "overall_retention": self.overall_retention,
            **({"sparse_density": self.sparse_density()} if self.sparse else {}),
            "drop_points": [
                {"layer": p.layer, "entering": list(p.entering), "kept": list(p.kept), "retention": p.retention}
                for p in self.points
            ],
        }

    def __str__(self) -> str:
        lines = [f"drop history: {self.rows} row(s) x {self.seq_len} tokens"]
        for p in self.points:
            lines.append(f"  layer {p.layer:3d}: kept {sum(p.kept):7d} / {sum(p.entering):7d}  ({p.retention:6.1%})")
        return "\n".join(lines)


class DropRecorder:
    """Collects the drop history of the latest forward call of one compiled model."""

    def __init__(self, policy: str = "cumulative") -> None:
        self.policy = policy
        self._current: DropHistory | None = None
        self.last: DropHistory | None = None

    def begin(self, rows: int, seq_len: int) -> None:
        self._current = DropHistory(int(rows), int(seq_len), policy=self.policy)
        self.last = self._current

    def record_sparse(self, layer: int, density: torch.Tensor) -> None:
        if self._current is None:
            raise RuntimeError("DropRecorder.record_sparse called before begin")
        self._current.sparse[layer] = density

    def record_attention(self, layer: int, softcap: float, upcast: bool, sinks: bool, key_bias: bool = False) -> None:
        if self._current is None:
            raise RuntimeError("DropRecorder.record_attention called before begin")
        self._current.attention[layer] = (float(softcap), bool(upcast), bool(sinks))
        if key_bias:
            self._current.key_bias_layers.add(layer)

    def record(self, layer: int, counts_in: torch.Tensor, counts_out: torch.Tensor, kept_flat=None) -> None:
        if self._current is None:
            raise RuntimeError("DropRecorder.record called before begin")
        self._current.points.append(DropPoint(
            layer, tuple(int(c) for c in counts_in.tolist()), tuple(int(c) for c in counts_out.tolist()), kept_flat))


_RECORDING: contextvars.ContextVar = contextvars.ContextVar("uniprefill_drop_recorder", default=None)


@contextlib.contextmanager
def recording_into(recorder: DropRecorder | None):
    """Make `recorder` the one the rewritten graph's recorder ops write into, for this block."""
    token = _RECORDING.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDING.reset(token)


def active_recorder() -> DropRecorder | None:
    return _RECORDING.get()
