"""Attention nodes copied as `uniprefill::dense_attention` / `packed_attention`.

Before the first drop point an attention node runs on the dense (B, N) grid; after it, on a
packed layout. Either way the replacement rebuilds causal, sliding-window and padding masks
from ORIGINAL positions (so a window after a drop is still a window over original positions),
and one mask is built per (window, padding input) before the first drop and per (layout,
window) after it. A DeepSeek sparse attention call (`passes/indexer_mask.py`) keeps the graph's own
mask (its indexer's top-k runs on the kept tokens); after a drop the causal mask it reads is
`packed_visibility`, built from original positions. Mixed into `token_drop.TokenDropPass`, whose state it reads.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..models.layer_kinds import LayerKind
from .classify import LayerInfo
from .fx_utils import example_value, is_sink_attention
from .plan import RewriteSkipped

U = torch.ops.uniprefill


class AttentionCopy:
    def _copy_attention(self, node: fx.Node, info: LayerInfo, mask) -> None:
        j = self._node_layout(node)
        q, k, v = node.args[:3]
        if mask.indexer is not None:  # DSA: the graph's own mask, its causal part rebuilt after a drop
            self._copy_node(node, j > 0)
            self.counts["indexer_attention"] = self.counts.get("indexer_attention", 0) + 1
            return
        if not mask.recognized:
            if j > 0:
                raise RewriteSkipped(f"attention {node.name} after a drop point has a mask that is not understood: {mask.reason}")
            self._copy_node(node, False)
            return
        scale = node.kwargs.get("scale", node.args[6] if len(node.args) > 6 else None)
        if scale is None:
            scale = 1.0 / math.sqrt(example_value(q).shape[-1])
        elif isinstance(scale, fx.Node):
            scale = self.env[scale]
        gqa = bool(node.kwargs.get("enable_gqa", False))
        qn, kn, vn = (self._value_at(x, j) for x in (q, k, v))
        if is_sink_attention(node):  # passes/sink_attention.py
            self._copy_sink_attention(node, info.index, j, mask, qn, kn, vn, scale)
            return
        if j == 0:
            key_valid, shared = self._dense_mask_for(qn, mask)
            if self.config.early_sparse and info.kind is LayerKind.FULL and mask.window == 0:
                out = self._sparse_attention(qn, kn, vn, key_valid, shared, scale, info.index)
            else:
                out = self.new.call_function(U.dense_attention.default,
                                             (qn, kn, vn, key_valid, mask.window, scale, gqa, shared))
                self.counts["dense_attention"] += 1
        else:
            lay = self.layouts[j]
            shared = self._packed_mask_for(qn, j, mask.window)
            out = self.new.call_function(U.packed_attention.default,
                                         (qn, kn, vn, lay.positions, lay.counts, mask.window, scale, gqa, shared))
            self.counts["packed_attention"] += 1
        out.meta = dict(node.meta)
        self.env[node] = out
        self.layout_of[node] = j

    def _packed_visibility(self, visible: fx.Node, j: int) -> fx.Node:
        """A DSA layer's causal mask `visible` on layout j's kept tokens, rebuilt from ORIGINAL
        positions and rows (`uniprefill::packed_visibility`), once per (mask, layout)."""
        key = (visible, ("visible", j))
        if key not in self.memo:
            lay = self.layouts[j]
            self.memo[key] = self.new.call_function(
                U.packed_visibility.default, (self.env[visible], lay.positions, lay.counts))
            self.counts["packed_visibility"] = self.counts.get("packed_visibility", 0) + 1
        return self.memo[key]

    def _dense_mask_for(self, q, mask) -> tuple:
        """(the padding input or None, the `dense_mask` node shared by every layer with this
        (window, padding input), or None when causal attention needs no mask)."""
        key_valid = self.env[mask.padding] if mask.padding is not None else None
        if key_valid is None and mask.window <= 0:
            return None, None
        key = (mask.window, mask.padding)
        if key not in self._dense_masks:
            self._dense_masks[key] = self.new.call_function(
                U.dense_mask.default, (q, key_valid, mask.window, self._live_counts(mask.padding)))
            self.counts["dense_masks"] += 1
        return key_valid, self._dense_masks[key]

    def _packed_mask_for(self, q, j: int, window: int):
        """The `packed_masks` node shared by every layer of layout j with this window, or None."""
        if window <= 0:
            return None
        key = (j, window)
        if key not in self._packed_masks:
            lay = self.layouts[j]
            self._packed_masks[key] = self.new.call_function(
                U.packed_masks.default,
                (q, lay.positions, lay.counts, window, self.config.window_positions == "compacted"))
            self.counts["packed_masks"] += 1
        return self._packed_masks[key]

    def _sparse_attention(self, q, k, v, key_valid, shared, scale, layer: int) -> fx.Node:
        """`uniprefill::sparse_attention` for a full-attention layer before the first drop
        point (config.early_sparse_*); its density goes to the drop recorder."""
        cfg = self.config
        self._ensure_layout0()  # the recorder's begin_prefill comes first
        keep = -1.0 if cfg.early_sparse_keep is None else float(cfg.early_sparse_keep)
        p = 1.0 if cfg.early_sparse_p is None else float(cfg.early_sparse_p)
        both = self.new.call_function(U.sparse_attention.default, (
            q, k, v, key_valid, shared, scale, p, keep, cfg.early_sparse_window, cfg.last_q, cfg.sink,
            cfg.effective_min_tokens, cfg.impl))
        density = self.new.call_function(operator.getitem, (both, 1))
        self.new.call_function(U.record_sparse.default, (layer, density))
        self.counts["sparse_attention"] = self.counts.get("sparse_attention", 0) + 1
        return self.new.call_function(operator.getitem, (both, 0))

    def _live_counts(self, padding: fx.Node | None) -> fx.Node | None:
        """Host per-row real-token counts, when they come from this mask's padding input."""
        if padding is None or len(self.plan.padding) != 1 or padding not in self.plan.padding:
            return None
        self._ensure_layout0()
        return self.layouts[0].counts
