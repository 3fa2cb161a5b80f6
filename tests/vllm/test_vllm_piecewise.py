"""Token dropping under vLLM's default compilation (mode 3) on CPU: `uniprefill.vllm.piecewise` wraps a
stand-in of vLLM's backend (`fake_vllm_compile.py`: the graph split at the splitting ops, the pieces
between them compiled by Inductor) in the fake paged-KV vLLM of `fake_vllm_model.py`.

Reference: the mode-2 path (`compile_with_drops`: the same rewrite, run eagerly), whose drops
`test_vllm_rewrite.py` checks against plain PyTorch, and the model without any rewrite.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from fake_vllm_compile import FakeVllmBackend, fake_mode3_config
from fake_vllm_model import (BLOCK, LAYERS, VOCAB, WORLD, TinyBackbone, compile_with_drops, fake_context,
                             fake_window_layer)
from uniprefill.config import UniPrefillConfig
from uniprefill.vllm import piecewise
from uniprefill.vllm.graph_ops import SPLITTING_OPS
from uniprefill.vllm.metadata import SkipReason
from uniprefill.vllm.plugin import VllmHooks

FAKE_SPLITTING_OPS = ["uniprefill_fakevllm::unified_attention_with_output", "uniprefill_fakevllm::unified_kv_cache_update"]
SETTINGS = {"keep_ratio": 0.5, "block_size": BLOCK, "last_q": 16, "sink": 16, "min_tokens": 64, "vllm_drop": True}


@pytest.fixture(scope="module")
def model():
    return TinyBackbone().eval()


@pytest.fixture
def runtimes(monkeypatch):
    """vLLM's backend class wrapped by the plugin, with hooks into the fake vLLM; the drop runtimes
    the rewrites made (the hooks' listeners)."""
    made = []
    listeners = types.SimpleNamespace(add=made.append)
    hooks = VllmHooks(context_fn=lambda: WORLD.context, request_ids_fn=lambda: WORLD.context.request_ids,
                      num_prompt_tokens_fn=lambda: getattr(WORLD.context, "num_prompt_tokens", None),
                      listeners=listeners, window_layer_fn=fake_window_layer)
    monkeypatch.setattr(VllmHooks, "from_vllm", classmethod(lambda cls: hooks))
    assert piecewise.install(FakeVllmBackend) and not piecewise.install(FakeVllmBackend)
    yield made
    assert piecewise.uninstall(FakeVllmBackend)
    torch._dynamo.reset()


def compile_mode3(model, settings, **compilation):
    """torch.compile as vLLM's mode 3 does it: dynamo hands the whole graph to a `VllmBackend`."""
    compilation.setdefault("splitting_ops", FAKE_SPLITTING_OPS)
    config = fake_mode3_config(settings, layers=LAYERS, block=BLOCK, **compilation)
    backends = []

    def backend(gm, example_inputs):
        backends.append(FakeVllmBackend(config))
        return backends[-1](gm, example_inputs)

    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True), backends


def compile_and_run_once(model, settings, query_lens=(120,)):
    """Compile as mode 3 does and run one step of these prompt lengths; the backend that compiled."""
    compiled, backends = compile_mode3(model, settings)
    ids, positions = batch(list(query_lens))
    WORLD.context = fake_context(list(query_lens))
    with torch.no_grad():
        compiled(ids, positions)
    return backends[-1]


def batch(query_lens, seed=1):
    ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=torch.Generator().manual_seed(seed))
    return ids, torch.cat([torch.arange(q) for q in query_lens])


def uniprefill_ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if str(n.target).startswith("uniprefill.")}


@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
def test_inductor_pieces_after_the_drop_match_the_eager_rewrite(model, runtimes, drops):
    """The rewritten graph split at vLLM's and uniprefill's splitting ops, the pieces after a drop
    compiled by Inductor for the drop's unbacked row count: every output row equals the eager
    rewrite's (mode 2), over batches of several shapes; the settings never reach Inductor, and
    vLLM's AOT cache would save the original graph."""
    eager, state = compile_with_drops(model, UniPrefillConfig(**{k: v for k, v in SETTINGS.items() if k != "vllm_drop"}),
                                      drops)
    batches = [batch(query_lens, seed) for seed, query_lens in enumerate(([300, 40, 170], [500], [64, 100, 30, 90]))]
    lens = [[300, 40, 170], [500], [64, 100, 30, 90]]
    references, plains = [], []
    with torch.no_grad():
        for query_lens, (ids, positions) in zip(lens, batches):
            WORLD.context = fake_context(query_lens)
            references.append(eager(ids, positions))
            WORLD.context = fake_context(query_lens)
            plains.append(model(ids, positions))
    assert state["runtime"].step.points  # the reference dropped
    torch._dynamo.reset()  # one compiled entry per test: dynamo caches by code object
    compiled, backends = compile_mode3(model, dict(SETTINGS, drop_layers=list(drops)))
    for query_lens, (ids, positions), reference, plain in zip(lens, batches, references, plains):
        WORLD.context = fake_context(query_lens)
        with torch.no_grad():
            ours = compiled(ids, positions)
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)
        runtime = runtimes[-1]  # (the tiny model's float `.item()` makes Inductor restart dynamo once)
        assert [p.layer for p in runtime.step.points] == list(drops)
        assert sum(runtime.step.points[-1].kept) < sum(runtime.step.points[0].entering)  # rows were dropped
        last = torch.tensor(query_lens).cumsum(0) - 1
        assert not torch.allclose(ours[last], plain[last], atol=1e-3)  # and the answer moved with them
    backend = backends[-1]
    assert "uniprefill" not in backend.inductor_config  # Inductor rejects unknown options
    # backed row counts need no fallback hint (`test_pieces_after_a_drop_are_compiled_for_backed_row_counts`)
    assert "unbacked_symint_fallback" not in backend.inductor_config
    assert set(SPLITTING_OPS) <= set(backend.compilation_config.splitting_ops)
    assert len(backend.pieces) >= LAYERS + 1  # one piece between each pair of attention ops, after the drop too
    assert uniprefill_ops(backend.compiled.graph_module) == set()  # the original graph, rewritten anew on load


def test_a_piecewise_cuda_graph_step_keeps_every_row_from_one_tensor(model, runtimes):
    """A step vLLM runs as piecewise CUDA graphs (the forward context says PIECEWISE): the pieces after
    the drop replay for the captured row count, so nothing drops (reason CUDA_GRAPH) and the rows the
    drop point returns are views of one persistent tensor; the output is the plain model's."""
    compiled, _ = compile_mode3(model, dict(SETTINGS, drop_layers=[1]))
    query_lens = [150, 90]
    ids, positions = batch(query_lens)
    pointers = []
    for _ in range(2):
        WORLD.context = fake_context(query_lens)
        WORLD.context.cudagraph_runtime_mode = types.SimpleNamespace(name="PIECEWISE")
        with torch.no_grad():
            ours = compiled(ids, positions)
        runtime = runtimes[-1]
        assert runtime.step.reasons.tolist() == [SkipReason.CUDA_GRAPH] * 2
        pointers.append(runtime._all_rows(ids).data_ptr())
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        plain = model(ids, positions)
    torch.testing.assert_close(ours, plain, atol=2e-5, rtol=2e-5)
    assert pointers[0] == pointers[1]


def test_a_config_without_settings_is_left_to_vllm(model, runtimes):
    backend = compile_and_run_once(model, None)
    assert backend.compilation_config.splitting_ops == FAKE_SPLITTING_OPS and not runtimes
    assert backend.hashed_files == set()  # vLLM's compile-cache key as vLLM makes it


@pytest.mark.parametrize("compilation, reason", [
    ({"use_inductor_graph_partition": True}, "use_inductor_graph_partition"),
    ({"splitting_ops": []}, "no splitting_ops"),
    ({"compile_sizes": [256]}, "compile_sizes"),
])
def test_what_mode_3_cannot_drop_runs_unaccelerated_with_the_reason(model, runtimes, compilation, reason):
    compiled, backends = compile_mode3(model, dict(SETTINGS, drop_layers=[1]), **compilation)
    query_lens = [200]
    ids, positions = batch(query_lens)
    WORLD.context = fake_context(query_lens)
    with pytest.warns(UserWarning, match=reason), torch.no_grad():
        ours = compiled(ids, positions)
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        plain = model(ids, positions)
    torch.testing.assert_close(ours, plain, atol=2e-5, rtol=2e-5)
    assert not runtimes and "uniprefill" not in backends[0].inductor_config
    # the engine's cache key holds the rewrite's code even where this backend ran unrewritten: vLLM names the
    # directory at an engine's first backend call, and a later one (another compiled module) may be rewritten
    assert any(path.endswith("uniprefill/vllm/rewrite.py") for path in backends[0].hashed_files)


def test_mega_artifact_runs_unaccelerated():
    config = fake_mode3_config(SETTINGS, layers=LAYERS, block=BLOCK, splitting_ops=FAKE_SPLITTING_OPS)
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" in piecewise.unaccelerated_reason(config, mega_artifact=True)
    assert piecewise.unaccelerated_reason(config, mega_artifact=False) is None


def test_a_step_that_drops_nothing_leaves_vllms_metadata_untouched(model, runtimes):
    """p = 1 keeps every row: the later layers then read the very metadata objects vLLM built (FA3's
    ahead-of-time plan included, which a replaced object would lose: on the H200 that changed FA3's
    schedule and so the last bits of attention), and the output is the plain model's. A step in which
    rows drop replaces them."""
    compiled, _ = compile_mode3(model, {**SETTINGS, "keep_ratio": None, "p": 1.0, "drop_layers": [1]})
    query_lens = [300, 40, 170]
    ids, positions = batch(query_lens)
    context = WORLD.context = fake_context(query_lens)
    plan = object()
    for meta in context.attn_metadata.values():
        meta.scheduler_metadata = plan
    built = dict(context.attn_metadata)
    with torch.no_grad():
        ours = compiled(ids, positions)
    runtime = runtimes[-1]
    assert runtime.step.points and not runtime.step.changed
    assert all(context.attn_metadata[name] is meta for name, meta in built.items())
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        plain = model(ids, positions)
    torch.testing.assert_close(ours, plain, atol=2e-5, rtol=2e-5)
    WORLD.context = context = fake_context(query_lens)  # and with rows dropped, the later layers' objects change
    built = dict(context.attn_metadata)
    torch._dynamo.reset()
    dropping, _ = compile_mode3(model, dict(SETTINGS, drop_layers=[1]))
    with torch.no_grad():
        dropping(ids, positions)
    assert runtimes[-1].step.changed
    later = [name for name in built if name.startswith(("model.layers.2.", "model.layers.3."))]
    assert later and all(context.attn_metadata[name] is not built[name] for name in later)


def test_settings_without_vllm_drop_leave_the_graph_to_vllm_with_the_reason(model, runtimes):
    """The option present but `vllm_drop` off: vLLM compiles its own graph (no uniprefill op, the
    splitting ops as vLLM set them), the settings still never reach Inductor, and the log says why."""
    compiled, backends = compile_mode3(model, {"p": 0.9})
    query_lens = [200]
    ids, positions = batch(query_lens)
    WORLD.context = fake_context(query_lens)
    with pytest.warns(UserWarning, match="vllm_drop"), torch.no_grad():
        ours = compiled(ids, positions)
    WORLD.context = fake_context(query_lens)
    with torch.no_grad():
        plain = model(ids, positions)
    torch.testing.assert_close(ours, plain, atol=2e-5, rtol=2e-5)
    backend = backends[-1]
    assert not runtimes and "uniprefill" not in backend.inductor_config
    assert backend.compilation_config.splitting_ops == FAKE_SPLITTING_OPS
    assert uniprefill_ops(backend.compiled.graph_module) == set()


def test_pieces_after_a_drop_are_compiled_for_backed_row_counts(model, runtimes, monkeypatch):
    """The kept row counts reach Inductor as backed symbols (`backed_rows`): no compiled piece sees an
    unbacked size, and Inductor fuses the pieces after the drop as it fuses vLLM's (with unbacked counts
    it gives their dependencies no memory score and splits kernels: more kernels for the same piece).
    The answer is the eager rewrite's either way."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from uniprefill.vllm import backed_rows

    query_lens = [300, 40, 170]
    ids, positions = batch(query_lens)
    kernels, outputs = {}, {}
    for backed in (True, False):
        if not backed:
            monkeypatch.setattr(backed_rows, "back_kept_row_counts", lambda gm: backed_rows.BackedRows({}))
        torch._dynamo.reset()
        compiled, backends = compile_mode3(model, dict(SETTINGS, drop_layers=[1]),
                                           inductor_options={"force_disable_caches": True})
        WORLD.context = fake_context(query_lens)
        with torch.no_grad():
            outputs[backed] = compiled(ids, positions)
        backend = backends[-1]
        unbacked = [name for name, inputs in backend.piece_inputs.items() if free_unbacked_symbols(inputs)]
        assert (unbacked == []) if backed else len(unbacked) >= 2  # the pieces after the drop
        assert sum(runtimes[-1].step.points[-1].kept) < sum(query_lens)  # it dropped
        kernels[backed] = backend.piece_kernels
        # unbacked counts get the token count's hint (the size dynamo traced) instead of Inductor's 8192
        assert backend.inductor_config.get("unbacked_symint_fallback") == (None if backed else sum(query_lens))
    assert kernels[True].keys() == kernels[False].keys()
    assert all(kernels[True][name] <= kernels[False][name] for name in kernels[True])
    assert sum(kernels[True].values()) < sum(kernels[False].values())  # fused where unbacked counts split
    torch.testing.assert_close(outputs[True], outputs[False], atol=2e-5, rtol=2e-5)


def test_row_counts_stay_unbacked_where_vllm_checks_guards_or_is_unbacked_itself():
    from uniprefill.vllm.backed_rows import skip_reason

    def config(**dynamic):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(
            dynamic_shapes_config=types.SimpleNamespace(**dynamic)))

    assert skip_reason(config(evaluate_guards=False, type="DynamicShapesType.BACKED")) is None
    assert skip_reason(types.SimpleNamespace(compilation_config=types.SimpleNamespace())) is None  # older vLLM
    assert "evaluate_guards" in skip_reason(config(evaluate_guards=True, type="backed"))
    assert "unbacked" in skip_reason(config(evaluate_guards=False, type="DynamicShapesType.UNBACKED"))


def test_guards_on_the_backed_row_counts_are_forgotten_after_compiling():
    """Inductor may guard on a backed row count (e.g. its int32 indexing bound); dynamo would turn such
    a guard into a check on an input size that does not exist (an IndexError in `produce_guards`, seen
    with Inductor's Triton code), so the hook drops those guards once the pieces are compiled."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from uniprefill.vllm.backed_rows import BackedRows

    env = ShapeEnv()
    tokens = env.create_symbol(4096, ConstantSource("tokens"), dynamic_dim=DimDynamic.DYNAMIC)
    kept = env.create_symbol(4095, ConstantSource("kept"), dynamic_dim=DimDynamic.DYNAMIC)
    assert env.evaluate_expr(tokens > 100) and env.evaluate_expr(kept * 576 < 2**31)
    assert len(env.guards) == 2
    assert BackedRows({"u0": str(kept)}, env, frozenset({kept})).forget_guards() == 1
    assert [g.expr.free_symbols for g in env.guards] == [{tokens}]  # the token count's own guard stays
    assert BackedRows({}).forget_guards() == 0


@pytest.mark.parametrize("guard, sound", [("int32_bound", True), ("kept_differs_from_tokens", False)])
def test_guards_inductor_adds_on_the_row_counts_while_compiling(model, runtimes, monkeypatch, guard, sound):
    """End to end: a guard decided on a backed row count's hint while the pieces compile (stand-in for
    Inductor's own, which its Triton code adds and its C++ code here does not). A bound every count meets
    is dropped before dynamo builds its guards (it would fail on them), the answer is the eager rewrite's;
    a guard false at p = 1 (kept == all rows) fails the compile loudly instead of compiling wrong pieces."""
    import sympy

    import fake_vllm_compile

    compile_piece = fake_vllm_compile.standalone_compile
    guarded = []

    def compile_and_guard(module, args, **kwargs):
        sizes = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()
                 and isinstance(a.shape[0], torch.SymInt) and a.shape[0].node.expr.is_Symbol]
        if sizes:
            env = sizes[0].node.shape_env
            symbols = sorted({s.node.expr for s in sizes}, key=lambda s: -int(env.var_to_val[s]))
            for row in symbols[1:] if len(symbols) > 1 else []:
                guarded.append(row)
                if guard == "int32_bound":
                    env.evaluate_expr(row * 576 < 2 ** 31)
                else:
                    env.evaluate_expr(sympy.Ne(row, symbols[0]))
        return compile_piece(module, args, **kwargs)

    monkeypatch.setattr(fake_vllm_compile, "standalone_compile", compile_and_guard)
    torch._dynamo.reset()
    compiled, backends = compile_mode3(model, dict(SETTINGS, drop_layers=[1]))
    query_lens = [300, 40, 170]
    ids, positions = batch(query_lens)
    WORLD.context = fake_context(query_lens)
    if not sound:
        with pytest.raises(Exception, match="a drop can break"), torch.no_grad():
            compiled(ids, positions)
        return
    with torch.no_grad():
        ours = compiled(ids, positions)
    env = backends[-1].piece_inputs[backends[-1].pieces[-1]][0].shape[0].node.shape_env
    assert guarded and not [g for g in env.guards if "576" in str(g.expr)]  # added on the row counts, then dropped
    assert sum(runtimes[-1].step.points[-1].kept) < sum(query_lens)
    WORLD.context = fake_context(query_lens)
    eager, _ = compile_with_drops(model, UniPrefillConfig(**{k: v for k, v in SETTINGS.items() if k != "vllm_drop"}),
                                  (1,))
    with torch.no_grad():
        torch.testing.assert_close(ours, eager(ids, positions), atol=2e-5, rtol=2e-5)


def test_what_inductor_may_not_assume_about_a_row_count():
    """`BackedRows.unsound_reason`. Refused: a replacement (a count specialised on its hint), a divisibility
    some count breaks, a relation to another count false at p = 1. Trusted, as vLLM trusts them for its
    own token count: a threshold on one count (the int32 bound, a heuristic's `rows > 100`), "not
    divisible" (the unaligned path), a view's divisibility every count meets, `rows <= tokens`."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from uniprefill.vllm.backed_rows import BackedRows

    def fresh():
        env = ShapeEnv()
        tokens = env.create_symbol(4096, ConstantSource("tokens"), dynamic_dim=DimDynamic.DYNAMIC)
        kept = env.create_symbol(4095, ConstantSource("kept"), dynamic_dim=DimDynamic.DYNAMIC)
        rows = BackedRows({"u0": str(kept)}, env, frozenset({kept}), tokens, env.var_to_range[tokens], (kept,))
        return env, tokens, kept, rows

    env, tokens, kept, rows = fresh()
    env.evaluate_expr(kept * 576 < 2 ** 31)
    env.evaluate_expr(kept > 100)
    env.evaluate_expr(sympy.Eq(sympy.Mod(kept, 8), 0))  # false on the odd hint: Ne(Mod(kept, 8), 0)
    env.evaluate_expr(kept <= tokens)
    env.divisible.add(sympy.Mod(96 * kept, 96))
    assert rows.unsound_reason() is None and rows.forget_guards() == 4
    env, tokens, kept, rows = fresh()
    env.evaluate_expr(sympy.Eq(kept, 4095))  # specialised on the hint: a replacement
    assert "replaced" in rows.unsound_reason()
    env, tokens, kept, rows = fresh()
    env.evaluate_expr(sympy.Lt(kept, tokens))
    assert "false for counts" in rows.unsound_reason()
    with pytest.raises(RuntimeError, match="a drop can break"):
        rows.forget_guards()
    env, tokens, kept, rows = fresh()
    env.divisible.add(sympy.Mod(kept, 16))
    assert "divisible" in rows.unsound_reason()
    env, tokens, kept, rows = fresh()
    env.replacements[kept] = tokens
    assert "replaced" in rows.unsound_reason()


@pytest.mark.parametrize("drops", [(1,), (1, 2)], ids=["one-drop", "two-drops"])
def test_p1_pieces_give_standard_modes_numbers_bit_for_bit(model, runtimes, drops):
    """p = 1 under mode 3 against the same model compiled by the same backend without the option: every
    output bit equal (`torch.equal`, no tolerance), over batches of several shapes. On the H200 this needed
    backed row counts (`backed_rows`) and the gathers as `uniprefill::gather_rows` (SmolLM2 then gave standard
    vLLM's logprobs on 120 of 120 prompts); Inductor's C++ kernels here sum alike without them, so the Triton
    side of it is `test_triton_pieces_on_cpu.py`'s. This guards the rest: the drop point, the metadata and
    the scatter at p = 1 change no bit."""
    lens = ([300, 40, 170], [500], [64, 100, 30, 90])
    batches = [batch(query_lens, seed) for seed, query_lens in enumerate(lens)]
    outputs = {}
    for name, settings in (("standard", None), ("p1", {**SETTINGS, "keep_ratio": None, "p": 1.0,
                                                         "drop_layers": list(drops)})):
        torch._dynamo.reset()
        compiled, _ = compile_mode3(model, settings, inductor_options={"force_disable_caches": True})
        outputs[name] = []
        for query_lens, (ids, positions) in zip(lens, batches):
            WORLD.context = fake_context(query_lens)
            with torch.no_grad():
                outputs[name].append(compiled(ids, positions))
    runtime = runtimes[-1]
    assert [p.layer for p in runtime.step.points] == list(drops)  # the p = 1 engine ran its drop points
    assert sum(runtime.step.points[-1].kept) == sum(lens[-1])  # and kept every row
    for standard, p1 in zip(outputs["standard"], outputs["p1"]):
        assert torch.equal(standard, p1), (standard - p1).abs().max()


def test_the_rewrites_sources_go_into_vllms_compile_cache_key(model, runtimes):
    """vLLM names its compile-cache directory by the config and the text of `traced_files` and loads each piece by its
    index: the code that rewrote the graph must be among those files, or an engine started after uniprefill changed
    would run pieces compiled from the graph the old code rewrote."""
    import uniprefill.passes
    import uniprefill.vllm

    traced = compile_and_run_once(model, SETTINGS).hashed_files  # what vLLM's backend read for its cache key
    assert runtimes  # rewritten
    vllm_dir, passes_dir = (Path(m.__file__).resolve().parent for m in (uniprefill.vllm, uniprefill.passes))
    assert {str(vllm_dir / "rewrite.py"), str(vllm_dir / "graph_ops.py"), str(passes_dir / "token_drop.py")} <= traced
    assert any(path.endswith("kernels/api.py") for path in traced)  # the kernels behind the inserted ops
    assert all(Path(path).is_file() for path in traced)


def test_a_vllm_without_traced_files_gets_nothing_added():
    assert piecewise.add_rewrite_sources(types.SimpleNamespace()) == 0
    config = types.SimpleNamespace(traced_files={"model.py"})
    added = piecewise.add_rewrite_sources(config)
    assert added > 20 and len(config.traced_files) == added + 1
    assert piecewise.add_rewrite_sources(config) == 0  # a set: the same files once (vLLM clears it after each call)
