"""Which SDPA kernels decode steps may use: "default", or "no-cudnn".

On the H200 box (torch 2.11, cuDNN 9), SDPA picks cuDNN's attention for a single masked
query, and cuDNN builds an execution plan for every new key length, i.e. at every decode
step: 2-4 ms per layer per token, for the plain model as for ours (measured:
`docs/results/probe-eval-speed-h200.log`). "no-cudnn" leaves cuDNN out of decode steps
(one-token forwards) only; prefills, the work TTFT measures, keep the default kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

CHOICES = ("default", "no-cudnn")


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"decode SDPA choice {choice!r}: use one of {CHOICES}")
    return choice


@contextlib.contextmanager
def decode_sdpa(choice: str) -> Iterator[None]:
    """Enter the SDPA kernel choice for one decode step (no-op for "default")."""
    if check_choice(choice) == "default":
        yield
        return
    from uniprefill.runtime.decode_attention import decode_kernels

    with decode_kernels():  # the kernels uniprefill's own decode steps use
        yield


def for_decode_steps(forward: Callable, choice: str) -> Callable:
    """`forward` with one-token calls (decode steps) run under `decode_sdpa(choice)`."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1:
            with decode_sdpa(choice):
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)

    return wrapped
