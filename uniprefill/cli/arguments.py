"""Command-line values: parsed and checked before a model is loaded, then turned into configs, devices and models.

A bad value raises `UsageError` (a `ValueError`), which the subcommand reports as a usage error.
Environment: UNIPREFILL_HAYSTACK names the essay haystack file when --haystack is not given.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_TYPES = ("float32", "bfloat16", "float16")


class UsageError(ValueError):
    """A bad command-line value; reported as a usage error of the subcommand."""

# ----------------------------------------------------------------------------- parsing


def parse_length(text: str) -> int:
    """"4096", "4k" or "128K" (K = 1024) -> tokens."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise UsageError(f"length {text!r} is not a number of tokens (e.g. 4096 or 4k)") from None
    if value <= 0:
        raise UsageError(f"length {text!r} must be positive")
    return value


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_drop_layers(text: str):
    if text in ("auto", "all"):
        return text
    try:
        return tuple(int(x) for x in _split(text))
    except ValueError:
        raise UsageError(f"--drop-layers {text!r}: give auto, all or layer indices like 7,11,15"
                         ) from None


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in _split(text)]
    except ValueError:
        raise UsageError(f"{what} {text!r} must be numbers separated by commas") from None


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in _split(text)]
    except ValueError:
        raise UsageError(f"{what} {text!r} must be integers separated by commas") from None


def _configs(args) -> list:
    """One UniPrefillConfig per (selection rule, drop set, policy, p); its ValueError names a bad value.

    `--drop-layers` holds one drop set or several separated by ";" (e.g. "all;auto;11,17").
    """
    from uniprefill.config import UniPrefillConfig

    drops = [parse_drop_layers(d.strip()) for d in args.drop_layers.split(";") if d.strip()]
    if not drops:
        raise UsageError(f"--drop-layers {args.drop_layers!r} names no drop set")
    sparse = [_early_sparse(text) for text in _split(getattr(args, "early_sparse", "off"))]
    window = getattr(args, "early_sparse_window", 1024)
    return [UniPrefillConfig(p=p, policy=policy, drop_layers=drop, window_positions=positions, selection=rule,
                             early_sparse_window=window, **extra)
            for rule in _split(args.selection) for positions in _split(args.window_positions) for drop in drops
            for policy in _split(args.policy) for p in _floats(args.p, "--p") for extra in sparse]


def _early_sparse(text: str) -> dict:
    """"off" -> {}; "p=0.9" -> {"early_sparse_p": 0.9}; "keep=0.1" -> {"early_sparse_keep": 0.1}."""
    if text == "off":
        return {}
    name, _, value = text.partition("=")
    if name not in ("p", "keep") or not value:
        raise UsageError(f"--early-sparse {text!r}: give off, p=X or keep=X")
    try:
        return {f"early_sparse_{name}": float(value)}
    except ValueError:
        raise UsageError(f"--early-sparse {text!r}: {value!r} is not a number") from None


def _peers(args) -> list:
    """One `PeerSpec` per --peer; a bad method or setting is a usage error."""
    from uniprefill.peers import parse_peer

    try:
        return [parse_peer(text) for text in getattr(args, "peer", [])]
    except ValueError as err:
        raise UsageError(f"--peer: {err}") from None


def _haystack(args) -> tuple[str | None, str]:
    """(path, where it came from), checked to exist."""
    path, source = args.haystack, "--haystack"
    from ..env import haystack_path

    if path is None and haystack_path():
        path, source = haystack_path(), "UNIPREFILL_HAYSTACK"
    if path is not None and not os.path.isfile(path):
        raise UsageError(f"haystack file {path!r} (from {source}) does not exist")
    return path, source


def _device_and_dtype(args):
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available")
    from uniprefill.bench.models import DTYPES

    name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return device, DTYPES[name]


def _check_model(spec: str, lengths: list[int]) -> None:
    from uniprefill.bench.models import check_lengths, local_config

    check_lengths(local_config(spec), lengths)


def _load(args, lengths: list[int], device, dtype, need_tokenizer: bool):
    from uniprefill.bench.models import check_lengths, load_model

    start = time.perf_counter()
    print(f"loading {args.model} on {device} (the default model is converted once, on first use) ...", file=sys.stderr)
    loaded = load_model(args.model, dtype=dtype, device=device, tokenizer=args.tokenizer,
                        num_layers=getattr(args, "num_layers", None))
    check_lengths(loaded.model.config, lengths)
    if need_tokenizer and loaded.tokenizer is None:
        raise UsageError(f"model {args.model!r} comes without a tokenizer: pass --tokenizer PATH")
    print(f"loaded {args.model} ({loaded.source}) on {device} in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return loaded


def _settings(args) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "handler"}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}", file=sys.stderr)

