"""`SelectionRule`: the settings of block selection, one checked, immutable value.

`api.select_blocks` and `api.score_and_select` (and the reference and Triton selections under
them) take one rule instead of seven keyword arguments: the block size, the forced blocks
(`sink`, `last_q`), the shortest sequence selected from (`min_tokens`), and the rule proper
(top-p `p` under `selection`, or a forced `keep_ratio`); `api.select_blocks` says what each
means. The values are checked once, when a rule is built, and a bad one raises `ValueError`
as the checks of `validation.py` do. `SelectionRule.from_config` reads a drop point's rule
from a `uniprefill.config.UniPrefillConfig` by duck typing: the kernels never import the
config.
"""

from __future__ import annotations

import dataclasses

import torch

from .names import SELECTIONS
from .validation import check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectionRule:
    """Which blocks of each sequence `api.select_blocks` keeps (its docstring has the rules).

    block_size: tokens per block.
    sink, last_q: the blocks touching a sequence's first `sink` or last `last_q` tokens are
        forced (always kept). `sink` is one number, or a host int32 / int64 tensor [B] with each
        sequence's own (a serving engine's last chunk of a prompt whose context holds its
        sink tokens forces none of them: one selection call for the whole step).
    min_tokens: a sequence shorter than max(min_tokens, sink + last_q)
        (`effective_min_tokens`; `sequence_min_tokens(sink)` with one sink per sequence) keeps
        every block.
    p: top-p in (0, 1]; the default 1.0 keeps every block. One number, or a host float32
        tensor [B] with each sequence's own p (`select_blocks` checks its length against the
        batch; its values are checked here, so do not change them in place afterwards).
    keep_ratio: None for top-p, or the share in (0, 1] of each sequence's tokens to keep
        (p is then ignored).
    selection: "paper" or "content", the top-p rule (whose score p is a share of).

    Frozen and hashable (a rule holding a p tensor hashes by the tensor's identity).
    """

    block_size: int
    sink: int | torch.Tensor
    last_q: int
    min_tokens: int
    p: float | torch.Tensor = 1.0
    keep_ratio: float | None = None
    selection: str = "paper"

    def __post_init__(self) -> None:
        _check_p(self.p)
        _check_keep_ratio(self.keep_ratio)
        check_int("block_size", self.block_size, low=1)
        _check_sink(self.sink)
        check_int("last_q", self.last_q, low=1)
        check_int("min_tokens", self.min_tokens, low=0)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} is not one of {SELECTIONS}")

    @property
    def effective_min_tokens(self) -> int:
        """Shortest sequence selected from: never below sink + last_q (shorter ones keep all). With one sink per
        sequence each has its own (`sequence_min_tokens`): this raises."""
        if self.per_sequence_sink:
            raise ValueError("a rule with one sink per sequence has no single effective_min_tokens: "
                             "use sequence_min_tokens(sink)")
        return self.sequence_min_tokens(self.sink)

    def sequence_min_tokens(self, sink: int) -> int:
        """Shortest sequence selected from, for a sequence with `sink` forced sink tokens."""
        return max(self.min_tokens, int(sink) + self.last_q)

    @property
    def per_sequence_p(self) -> bool:
        """Whether `p` is a tensor with one p per sequence."""
        return isinstance(self.p, torch.Tensor)

    @property
    def per_sequence_sink(self) -> bool:
        """Whether `sink` is a tensor with one sink count per sequence."""
        return isinstance(self.sink, torch.Tensor)

    def sinks(self, batch: int) -> list[int]:
        """Each of `batch` sequences' sink count."""
        return self.sink.tolist() if self.per_sequence_sink else [self.sink] * batch

    @classmethod
    def from_config(cls, config, drop_index: int, num_drop_points: int) -> SelectionRule:
        """The rule of the `drop_index`-th of a config's `num_drop_points` drop points.

        `config`: a `uniprefill.config.UniPrefillConfig`, or any object with its `block_size`,
        `sink`, `last_q`, `effective_min_tokens`, `p`, `selection` and
        `keep_ratio_at(drop_index, num_drop_points)`. A request's own p replaces `config.p`
        with `dataclasses.replace(rule, p=...)`.
        """
        return cls(
            block_size=config.block_size, sink=config.sink, last_q=config.last_q,
            min_tokens=config.effective_min_tokens, p=config.p,
            keep_ratio=config.keep_ratio_at(drop_index, num_drop_points), selection=config.selection,
        )


def _check_p(p) -> None:
    if isinstance(p, torch.Tensor):  # one p per sequence: its length is checked against the batch
        if p.dim() != 1 or p.dtype != torch.float32 or p.device.type != "cpu":
            raise ValueError(f"p as a tensor must be a host float32 tensor [B] (one p per sequence), "
                             f"got {p.dtype} {tuple(p.shape)} on {p.device}")
        if p.numel() and not bool(((p > 0.0) & (p <= 1.0)).all()):
            raise ValueError(f"p: every sequence's p must lie in (0, 1]; got {p.tolist()[:8]}")
    elif isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
        raise ValueError(f"p={p!r} must be a number in (0, 1] (or a host float32 tensor [B], one per sequence)")


def _check_sink(sink) -> None:
    if isinstance(sink, torch.Tensor):  # one sink per sequence: its length is checked against the batch
        if sink.dim() != 1 or sink.dtype not in (torch.int32, torch.int64) or sink.device.type != "cpu":
            raise ValueError(f"sink as a tensor must be a host int32 / int64 tensor [B] (one sink count per "
                             f"sequence), got {sink.dtype} {tuple(sink.shape)} on {sink.device}")
        if sink.numel() and not bool((sink >= 0).all()):
            raise ValueError(f"sink: every sequence's sink count must be >= 0; got {sink.tolist()[:8]}")
    else:
        check_int("sink", sink, low=0)


def _check_keep_ratio(keep_ratio) -> None:
    if keep_ratio is not None and (
        isinstance(keep_ratio, bool)
        or not isinstance(keep_ratio, (int, float))
        or not (0.0 < keep_ratio <= 1.0)
    ):
        raise ValueError(f"keep_ratio={keep_ratio!r} must be None or a number in (0, 1]")
