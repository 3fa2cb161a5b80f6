"""`PeerSpec`: which peer method runs the prefill attention, with which settings.

The settings are the peer's own knobs under its own names; a setting not given takes the
default of the peer's published code (`DEFAULTS`), so "flexprefill" alone is FlexPrefill as
a user of the `minference` package would get it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# method -> its settings with their defaults. Sources: minference 0.1.6.0's
# `flexprefill_forward` (gamma 0.9, tau 0.1, block 128, no budgets), `xattention_forward`
# (threshold 0.9, stride 8, block 128, chunk 2048; "estimate": "triton" runs its estimate's
# Triton path on any GPU, "package" the package's function as is, see xattention_estimate) and MInference's most common searched
# pattern ("vertical_and_slash", 1000 vertical lines, 6096 slash lines, last 64 queries).
# "blocks" is our stand-in: causal blocks kept by a fixed share of each query block's
# key blocks (1.0: every block), run by the PyTorch reference; for CPU tests and CI.
DEFAULTS: dict[str, dict[str, Any]] = {
    "flexprefill": {"gamma": 0.9, "tau": 0.1, "min_budget": None, "max_budget": None,
                    "block_size": 128},
    "xattention": {"threshold": 0.9, "stride": 8, "block_size": 128, "chunk_size": 2048,
                   "estimate": "triton"},
    "minference": {"vertical_size": 1000, "slash_size": 6096, "last_q": 64},
    "blocks": {"keep": 1.0, "block_size": 16},
}
PEER_METHODS = tuple(DEFAULTS)


@dataclass(frozen=True)
class PeerSpec:
    """A peer method and its settings.

    Attributes:
        method: one of `PEER_METHODS`.
        settings: (name, value) pairs, sorted; names not given take `DEFAULTS[method]`.
        min_tokens: prefills shorter than this run SDPA (the peers' kernels need a few blocks).
    """

    method: str
    settings: tuple[tuple[str, Any], ...] = ()
    min_tokens: int = 1024
    _resolved: dict[str, Any] = field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if self.method not in DEFAULTS:
            raise ValueError(f"peer method {self.method!r} is not one of {PEER_METHODS}")
        unknown = sorted({k for k, _ in self.settings} - set(DEFAULTS[self.method]))
        if unknown:
            raise ValueError(f"peer {self.method!r} has no setting {unknown}; its settings are "
                             f"{sorted(DEFAULTS[self.method])}")
        for name, value in self.settings:
            default = DEFAULTS[self.method][name]
            if value is None and default is not None:
                raise ValueError(f"{self.method} setting {name} cannot be none (default {default})")
            if isinstance(default, str) != isinstance(value, str) and value is not None:
                raise ValueError(f"{self.method} setting {name}={value!r}: expected "
                                 f"{'a name' if isinstance(default, str) else 'a number'}")
        if dict(self.settings).get("estimate", "triton") not in ("triton", "package"):
            raise ValueError(f"xattention estimate={dict(self.settings)['estimate']!r}: use triton or package")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        object.__setattr__(self, "settings", tuple(sorted(self.settings)))
        object.__setattr__(self, "_resolved", {**DEFAULTS[self.method], **dict(self.settings)})

    @property
    def resolved(self) -> dict[str, Any]:
        """Every setting of the method, the given ones over the defaults."""
        return dict(self._resolved)

    @property
    def label(self) -> str:
        items = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.settings]
        if self.min_tokens != 1024:
            items.append(f"min_tokens={self.min_tokens}")
        return f"{self.method}" + (f" {','.join(items)}" if items else " (defaults)")

    def stable_hash(self) -> str:
        text = json.dumps({"method": self.method, "settings": self.resolved,
                           "min_tokens": self.min_tokens}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "settings": self.resolved, "given": dict(self.settings),
                "min_tokens": self.min_tokens}


def _value(text: str) -> Any:
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_peer(text: str) -> PeerSpec:
    """"flexprefill", "xattention:threshold=0.8" or "minference:vertical_size=500,slash_size=2000"."""
    method, _, rest = text.strip().partition(":")
    settings = []
    min_tokens = 1024
    for item in filter(None, (x.strip() for x in rest.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"peer setting {item!r} in {text!r} is not name=value")
        if name.strip() == "min_tokens":
            min_tokens = int(value)
        else:
            settings.append((name.strip(), _value(value.strip())))
    return PeerSpec(method.strip(), tuple(settings), min_tokens)
