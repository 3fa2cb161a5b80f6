"""A causal mask sliced from a table the model holds (GPT-Neo, OpenAI-GPT), read as causal only while the table is.

Older models register a `[1, 1, M, M]` lower-triangular matrix as a buffer (`bias`, M the longest
prompt) and slice the prompt's block from it in every layer:

    GPT-Neo:     c = table[:, :, K - Q:K, :K];  logits = where(c, logits, finfo.min) (+ mask)
    OpenAI-GPT:  b = table[:, :, :Q, :K];       logits = logits * b + -1e4 * (1 - b) (+ mask)

Nothing in the graph says the table is causal: it is data (dynamo lifts the buffer to a graph input),
and GPT-Neo's local layers hold a band, `tril ^ tril(-W)` (each query sees its last W keys). So the
design has three parts, each where its kind of fact lives:

1. Matching (`table_masked`, a step of `sink_attention.match_sink_attention`): the masking step is
   read back to the scores it masks, the slice, and the model's own additive mask (padding) added
   after it. The site's mask becomes ONE node, `uniprefill::table_mask(slice, mask, dtype)` =
   `where(slice != 0, mask or 0, finfo(dtype).min)` (`sink_ops`), which `classify` reads as a mask.
2. Reading (`table_role`, from `mask_inputs.mask_input_roles`): the table input gets the role
   `TableRole(window)` only when the tensor it was traced with is exactly a band of ones (or True):
   visible at `k <= q` and `q - k < W` (W = 0: no window; GPT-Neo's global layers and OpenAI-GPT),
   zeros elsewhere. `classify` then reads the mask as causal with window W, and `mask_meaning` runs
   the mask's subgraph on that band. Any other table has no role: the layer is not rewritten, and
   the reason names the table (`mask_words`). A table held as a graph attribute (`get_attr`) is not
   an input the check below can see on each call, so it is not read either.
3. Checking (`TableRole.failed`, from `mask_inputs.failed_check`, on every call): the table input
   must still be that band, or the original graph runs with the reason. The verdict is kept for the
   tensor it was computed on (the same object, storage, `_version`, shape and strides): an in-place
   change bumps `_version` and is checked again; a tensor without a version counter (an inference
   tensor) is checked on every call. Checking once per tensor costs one pass over M * M values.

Arithmetic: GPT-Neo hides keys with the most negative float, as the rewrite does. OpenAI-GPT hides
them with -1e4: a hidden key's weight there is `exp(-1e4 - m) / Z` with m the row's largest visible
logit, which is 0 in float32 (and every narrower float) whenever m > -9896; the rewrite gives it 0
exactly. The scale is a product or a division by a positive number (`w / sqrt(d)`), or none (GPT-Neo).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .eager_attention_pieces import is_call
from .fx_utils import example_value

_HIDING_FILL = -1e4  # a fill at most this hides a key (see "Arithmetic" above)


# ------------------------------------------------------------------ the table's values
def band(m: int, window: int, device=None) -> torch.Tensor:
    """`[m, m]` boolean: key k visible to query q when `k <= q` and, with a window, `q - k < window`."""
    visible = torch.ones(m, m, dtype=torch.bool, device=device).tril_()
    return visible.triu_(-(window - 1)) if window > 0 else visible


def is_table_shaped(value) -> bool:
    """A `[1, 1, M, M]` boolean or floating tensor of static size M > 1 (a mask table, not a prompt's mask)."""
    if not (isinstance(value, torch.Tensor) and value.dim() == 4 and (value.dtype == torch.bool or value.is_floating_point())):
        return False
    sizes = value.shape
    return all(isinstance(s, int) for s in sizes) and sizes[0] == sizes[1] == 1 and sizes[2] == sizes[3] > 1


def band_window(table: torch.Tensor) -> int | None:
    """W when `table` is exactly `band(M, W)` (ones / True where visible, zeros elsewhere; W = 0: no
    window), else None."""
    if not is_table_shaped(table):
        return None
    plane = table[0, 0]
    m = plane.shape[-1]
    last = int((plane[-1] != 0).sum())  # the last query sees min(W, M) keys
    window = 0 if last == m else last
    want = band(m, window, plane.device)
    return window if torch.equal(plane, want if plane.dtype == torch.bool else want.to(plane.dtype)) else None


@dataclass
class _Verified:
    """The tensor a table check last passed on, and its identity then."""

    ref: object = None
    key: tuple | None = None


def _identity(value: torch.Tensor) -> tuple | None:
    try:
        version = value._version  # noqa: SLF001  (bumped by every in-place change)
    except RuntimeError:  # an inference tensor keeps no version counter: never cached
        return None
    return (value.data_ptr(), version, tuple(value.shape), value.stride(), value.dtype, value.device)


@dataclass(frozen=True, eq=False)
class TableRole:
    """The role of a mask-table input: a band of window `window` (0: causal, no window), checked on
    every call (`failed`). One per compiled graph: it keeps the verdict of the tensor last checked."""

    window: int
    shape: tuple
    _verified: _Verified = field(default_factory=_Verified, repr=False)
    value = "causal-mask table (a buffer the model holds)"  # read like an `InputRole`'s value

    def remember(self, table: torch.Tensor) -> None:
        self._verified.ref, self._verified.key = weakref.ref(table), _identity(table)

    def failed(self, table, name: str) -> str | None:
        """Why `table` is not the band this graph was rewritten for, or None."""
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != self.shape:
            return f"the causal-mask table {name} is not a {list(self.shape)} tensor at run time"
        seen = self._verified
        key = _identity(table)
        if key is not None and key == seen.key and seen.ref is not None and seen.ref() is table:
            return None  # the tensor that passed, unchanged since
        if band_window(table) != self.window:
            what = f"the causal band of {self.window} keys" if self.window else "lower-triangular (causal)"
            return (f"the causal-mask table {name} (a buffer the model holds) is no longer {what}, as it was when "
                    "the graph was rewritten: the rewrite does not model the mask it now gives")
        self.remember(table)
        return None


def table_role(node: fx.Node) -> TableRole | None:
    """The role of a placeholder a mask reads, when it is a table whose traced tensor is a band."""
    example = getattr(node.meta.get("grapharg"), "example", None)
    if not (is_table_shaped(example_value(node)) and isinstance(example, torch.Tensor)):
        return None
    window = band_window(example)
    if window is None:
        return None
    role = TableRole(window, tuple(example.shape))
    role.remember(example)
    return role


def evaluation_table(role: TableRole, like: torch.Tensor) -> torch.Tensor:
    """What the run-time check lets through, for `mask_meaning` to run a mask's subgraph on."""
    return band(role.shape[-1], role.window, like.device).to(like.dtype)[None, None]


# ------------------------------------------------------------------ the pattern
@dataclass(frozen=True)
class TableMasked:
    scores: fx.Node  # the logits the table masks
    mask: fx.Node | None  # the model's additive mask added after it (padding), or None
    table: fx.Node  # the slice of the table, `[1, 1, Q, K]`


def table_masked(logits, chain: list) -> TableMasked | None:
    """`where(slice, scores, fill) [+ mask]` or `scores * slice + fill * (1 - slice) [+ mask]`, the
    slice a `[1, 1, Q, K]` block of a table input and `fill` <= -1e4 -> its parts, else None."""
    step, mask, tried = logits, None, []
    if is_call(logits, "add") and len(logits.args) == 2 and not logits.kwargs:
        for a, m in (logits.args, logits.args[::-1]):
            mv = example_value(m)
            if (_step(a, []) is not None and isinstance(m, fx.Node) and isinstance(mv, torch.Tensor)
                    and mv.is_floating_point() and mv.dim() == 4):
                step, mask, tried = a, m, [logits]
                break
    found = _step(step, tried)
    if found is None:
        return None
    scores, table = found
    chain += tried
    return TableMasked(scores, mask, table)


def _step(node, chain: list):
    if is_call(node, "where") and len(node.args) == 3 and not node.kwargs:
        table, scores, fill = node.args
        if _is_slice(table, torch.bool) and _hiding(fill):
            chain += [node] + ([fill] if isinstance(fill, fx.Node) and len(fill.users) == 1 else [])
            return scores, table
        return None
    if not (is_call(node, "add") and len(node.args) == 2 and not node.kwargs):
        return None
    for kept, hidden in (node.args, node.args[::-1]):
        if not (is_call(kept, "mul") and is_call(hidden, "mul") and len(kept.args) == len(hidden.args) == 2):
            continue
        fill, complement = hidden.args if not isinstance(hidden.args[0], fx.Node) else hidden.args[::-1]
        if not (_hiding(fill) and is_call(complement, "sub") and complement.args[:1] in ((1,), (1.0,))
                and len(complement.args) == 2 and not complement.kwargs):
            continue
        table = complement.args[1]
        if not (_is_slice(table, None) and table in kept.args):
            continue
        scores = kept.args[1] if kept.args[0] is table else kept.args[0]
        chain += [node, kept, hidden, complement]
        return scores, table
    return None


def _is_slice(node, dtype) -> bool:
    """A `[1, 1, Q, K]` slice (getitem) of a table input, of `dtype` (None: floating)."""
    if not (is_call(node, "getitem") and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"):
        return False
    value, table = example_value(node), example_value(node.args[0])
    return (is_table_shaped(table) and isinstance(value, torch.Tensor) and value.dim() == 4
            and (value.dtype == dtype if dtype is not None else value.is_floating_point())
            and value.shape[0] == value.shape[1] == 1)


def _hiding(fill) -> bool:
    """A number at most -1e4, or a 0-dim `torch.tensor(number)` node of one."""
    if isinstance(fill, fx.Node):
        value = example_value(fill)
        if not (is_call(fill, "tensor") and isinstance(value, torch.Tensor) and value.dim() == 0 and fill.args):
            return False
        fill = fill.args[0]
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= _HIDING_FILL
