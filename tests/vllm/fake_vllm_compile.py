"""A stand-in for vLLM 0.26's mode-3 backend (`vllm.compilation.backends.VllmBackend`), enough to run
`uniprefill.vllm.piecewise` on CPU: what it does with the graph dynamo hands it, as read in vLLM's
source (`split_graph`, `PiecewiseCompileInterpreter`, `PiecewiseBackend`, `InductorStandaloneAdaptor`):

* split the graph at `compilation_config.splitting_ops` with `torch.fx.passes.split_module`
  (`keep_original_order`): each splitting op starts a piece of its own, consecutive splitting ops
  share one, and an `operator.getitem` goes into its first argument's piece;
* compile every other piece with Inductor (`torch._inductor.standalone_compile`, dynamic shapes
  "from_graph") on the fake values of its placeholders (`meta["example_value"]`), passing the
  Inductor options it holds (`inductor_config`, which rejects unknown keys);
* hash `compilation_config.traced_files` into the cache key and clear it (here: keep a copy, `hashed_files`);
* return an object with `optimized_call` (the split module) and `graph_module` (what its AOT-compile
  cache would save).

Splitting pieces run as plain FX modules, in Python, every call.
"""

from __future__ import annotations

import operator
import types

import torch
import torch.fx as fx
from torch._inductor import metrics, standalone_compile


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


class CompiledFunction:
    def __init__(self, graph_module, optimized_call):
        self.graph_module = graph_module
        self.optimized_call = optimized_call

    def __call__(self, *args):
        return self.optimized_call(*args)


class FakeVllmBackend:
    """`FakeVllmBackend(vllm_config)(graph, example_inputs)`, as vLLM's mode 3 calls its backend."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        self.inductor_config = dict(self.compilation_config.inductor_compile_config)
        self.pieces: list[str] = []  # names of the Inductor-compiled pieces
        self.splitting_pieces: list[str] = []
        self.piece_inputs: dict[str, list] = {}  # each compiled piece's fake inputs
        self.piece_kernels: dict[str, int] = {}  # kernels Inductor generated for each compiled piece

    def __call__(self, graph: fx.GraphModule, example_inputs):
        # vLLM hashes the text of `traced_files` into its compile-cache directory here, then clears the set
        traced = getattr(self.compilation_config, "traced_files", None)
        self.hashed_files = set(traced or ())
        if traced is not None:
            traced.clear()
        split_ops = set(self.compilation_config.splitting_ops or [])
        piece, ids, splitting = 0, {}, set()
        nodes = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
        for i, node in enumerate(nodes):
            if node.target is operator.getitem and node.args[0].op != "placeholder":
                ids[node] = ids[node.args[0]]
                continue
            if _op_name(node) in split_ops:
                piece += 1
                ids[node] = piece
                splitting.add(piece)
                following = nodes[i + 1] if i + 1 < len(nodes) else None
                piece += 1 if following is None or _op_name(following) not in split_ops else -1
            else:
                ids[node] = piece
        split = torch.fx.passes.split_module.split_module(graph, None, lambda n: ids[n], keep_original_order=True)
        options = {"config_patches": dict(self.inductor_config)}
        for name, module in list(split.named_children()):
            if int(name.removeprefix("submod_")) in splitting:
                self.splitting_pieces.append(name)
                continue
            args = [p.meta["example_value"] for p in module.graph.find_nodes(op="placeholder")]
            generated = metrics.generated_kernel_count
            split.__dict__[name] = standalone_compile(module, args, dynamic_shapes="from_graph", options=options)
            self.pieces.append(name)
            self.piece_inputs[name] = args
            self.piece_kernels[name] = metrics.generated_kernel_count - generated  # 0 on a cache hit
        self.split = split  # the split module, its compiled pieces in its __dict__
        self.compiled = CompiledFunction(graph, split)
        return self.compiled


def fake_mode3_config(settings, *, layers: int, block: int, splitting_ops=(), cudagraph_mode: str = "NONE",
                      inductor_options=None, sliding: tuple[tuple[int, ...], int] | None = None, **compilation):
    """A vLLM config in mode 3 with these uniprefill settings (None: none), splitting ops and further
    Inductor options; `sliding` (layers, window): those layers slide (the model config's `layer_types` and
    `sliding_window`, as Gemma-3's)."""
    ns = types.SimpleNamespace
    inductor = dict(inductor_options or {}) | ({} if settings is None else {"uniprefill": dict(settings)})
    compilation_config = ns(mode=3, backend="inductor", inductor_compile_config=inductor,
                            splitting_ops=list(splitting_ops), cudagraph_mode=ns(name=cudagraph_mode),
                            use_inductor_graph_partition=False, traced_files=set())
    for key, value in compilation.items():
        setattr(compilation_config, key, value)
    return ns(compilation_config=compilation_config,
              model_config=ns(hf_text_config=ns(num_hidden_layers=layers, **({} if sliding is None else {
                  "layer_types": ["sliding_attention" if i in sliding[0] else "full_attention" for i in range(layers)],
                  "sliding_window": sliding[1]})), max_model_len=4096, runner_type="generate"),
              cache_config=ns(block_size=block, enable_prefix_caching=False),
              parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1),
              scheduler_config=ns(enable_chunked_prefill=False, max_num_seqs=8), speculative_config=None)
