"""Why a graph or a call runs unaccelerated: a kind to test and count, and a message to read.

Every report of uniprefill that says "this ran unaccelerated" (`GraphReport.reason`
of both backends, `UniPrefillBackend.last_unaccelerated`) holds an
`Unaccelerated`: a `str` (the message, so printing, logging and matching it work as before) that
also carries a `kind` from `Kind`. Tests, the fuzzer and the census branch on the kind, never on
the wording.
"""

from __future__ import annotations

import enum


class Kind(str, enum.Enum):
    NOTHING_TO_DROP = "nothing_to_drop"  # a decode-step graph, or a prompt shorter than min_tokens
    NOT_INFERENCE = "not_inference"  # gradients enabled, or labels given: a loss needs every position
    LENGTH_SPECIALIZED = "length_specialized"  # the traced program holds for some prompt lengths only
    GRAPH_NOT_FOLLOWED = "graph_not_followed"  # the pass cannot follow the graph (op, layout, mask, ...)
    INPUT_NOT_MODELLED = "input_not_modelled"  # this call's padding, masks, positions or batch shape
    CACHE_NOT_DECODABLE = "cache_not_decodable"  # the model's cache cannot continue after a drop
    NOT_COMPILABLE = "not_compilable"  # torch.compile could not trace the model
    REWRITE_FAILED = "rewrite_failed"  # the rewritten graph raised (a bug): the original graph ran
    OPTION_OFF = "option_off"  # vLLM: dropping not switched on (`vllm_drop`)
    VLLM_NOT_SUPPORTED = "vllm_not_supported"  # vLLM: a model or engine setting the rewrite does not support


class Unaccelerated(str):
    """A message (the `str` itself) with its `kind`."""

    kind: Kind

    def __new__(cls, message: str, kind: Kind) -> Unaccelerated:
        obj = super().__new__(cls, message)
        obj.kind = Kind(kind)
        return obj

    def __reduce__(self):  # pickles (multiprocessing, caches) with its kind
        return (Unaccelerated, (str(self), self.kind))

    def prefixed(self, prefix: str) -> Unaccelerated:
        """The same kind, with `prefix` before the message."""
        return Unaccelerated(prefix + self, self.kind)


def kind_of(reason) -> Kind | None:
    """The kind of a reason (None for a plain string or None)."""
    return getattr(reason, "kind", None)
