"""`meta["val"]` on every node of a rewritten graph: what a later compiler pass reads.

Dynamo leaves a fake tensor (`meta["example_value"]`) on each node it traced. After the
token-drop rewrite those of the nodes past a drop point are stale (they still say N tokens where
the graph now carries T kept tokens), and the nodes the rewrite inserted have none.
`propagate_fake_values` runs the rewritten graph once on fake inputs (`FakeTensorProp`), in the
fake mode and shape environment dynamo traced it with, so every node gets a `meta["val"]` whose
sizes are the graph's own symbols: `s…` for the prompt length, an unbacked `u…` for each drop
point's kept count (`score_select`'s fake allocates it), `None` for the ops that return nothing
(the recorder ops).

The data-dependent sizes need `allow_dynamic_output_shape_ops` in that shape environment, which
dynamo creates without it (`torch._dynamo.config.capture_dynamic_output_shape_ops` is off by
default). The setting is switched on for this one propagation and restored after it, on that
environment object only (no process-wide flag is touched).

Cost: one fake run of the graph (about 3.5 s for 30 layers on a 2-core CPU, where the whole
first call takes about 21 s), so the backend runs it only when `config.debug` asks for the
dumps; a caller that hands the rewritten graph to another compiler runs it itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .fx_utils import example_value


def propagate_fake_values(gm: fx.GraphModule) -> int:
    """Set `meta["val"]` on every node of `gm` (see the module docstring); the number of nodes
    that got one. Raises ValueError when the graph's inputs carry no fake values (a graph not
    traced by dynamo)."""
    inputs = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in inputs if isinstance(v, FakeTensor)), None)
    if fake_mode is None or fake_mode.shape_env is None:
        raise ValueError("the graph's inputs carry no fake tensors with a shape environment (not a dynamo graph)")
    env = fake_mode.shape_env
    settings = env.settings
    env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True)
    try:
        with fake_mode, torch.no_grad():
            FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    finally:
        env.settings = settings
    count = 0
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        node.meta.setdefault("val", None)  # ops that return nothing
        count += 1
    return count
