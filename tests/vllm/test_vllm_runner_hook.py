"""vLLM's model-runner hook on CPU (`uniprefill/vllm/runner_hook.py`): request ids, finished requests, requests that
must keep every row, runner V2's prepared batch, and the per-request settings read from `SamplingParams`; split from
`test_vllm_rewrite.py`, whose fake vLLM they share."""

from __future__ import annotations

import types

import pytest
import torch


def test_runner_hook_supplies_request_ids_and_frees_finished_requests():
    from uniprefill.vllm import runner_hook as hook

    class Runner:  # the two methods and the batch fields of vLLM 0.26's GPUModelRunner it wraps
        def __init__(self):
            self.input_batch = types.SimpleNamespace(req_ids=["a", "b"],
                                                     num_prompt_tokens_cpu_tensor=torch.tensor([5, 7, 0, 0], dtype=torch.int32))

        def _update_states(self, scheduler_output):
            return "updated"

        def _model_forward(self, input_ids=None, positions=None):
            return hook.request_ids(), hook.num_prompt_tokens().tolist()

    listeners = hook.FinishedListeners()
    freed = []

    class Listener:  # held weakly by the listeners, like a runtime
        free = staticmethod(freed.append)

    listener = Listener()
    listeners.add(listener)
    assert hook.install(Runner, listeners) and not hook.install(Runner, listeners)  # idempotent
    runner = Runner()
    assert runner._model_forward(input_ids=None) == (("a", "b"), [5, 7])
    assert hook.current_step() is None  # only while the forward runs
    with pytest.raises(RuntimeError, match="not wrapped"):
        hook.request_ids()
    assert runner._update_states(types.SimpleNamespace(finished_req_ids={"a"})) == "updated"
    assert freed == ["a"]
    assert hook.uninstall(Runner) and not hook.uninstall(Runner)  # reversible, once
    with pytest.raises(RuntimeError, match="not wrapped"):
        Runner()._model_forward()  # vLLM's own method again: no step around it
    assert not hasattr(Runner._update_states, "__wrapped__") and hook.install(Runner, listeners)


def test_runner_hook_v1_frees_a_preempted_requests_history_and_keeps_its_settings():
    """vLLM frees a preempted request's KV and recomputes it when it resumes, possibly over a prefix-cache hit (its
    own earlier chunks, another request's prefix), so the recompute need not start at position 0, where the runtime
    would see the old history as stale; applied to the recompute, that history's removed entries would shift its
    rows into other slots. So the V1 hook frees the drop history at the preemption (vLLM 0.26's scheduler reports
    `preempted_req_ids` to either runner). V1 keeps the request across a preemption (it resumes among the cached
    requests, not the new ones), so its opt-out stays."""
    from uniprefill.vllm import runner_hook as hook

    seen = []

    class Runner:
        def __init__(self):
            self.input_batch = types.SimpleNamespace(req_ids=["p", "q"], num_prompt_logprobs={},
                                                     num_prompt_tokens_cpu_tensor=torch.tensor([5, 7], dtype=torch.int32))

        def _update_states(self, scheduler_output):
            return None

        def _model_forward(self, input_ids=None, positions=None):
            seen.append(hook.opted_out())

    listeners, freed = hook.FinishedListeners(), []

    class Listener:
        free = staticmethod(freed.append)

    listener = Listener()
    listeners.add(listener)
    assert hook.install(Runner, listeners)
    runner = Runner()
    arriving = [types.SimpleNamespace(req_id="p", sampling_params=types.SimpleNamespace(extra_args={"uniprefill": False})),
                types.SimpleNamespace(req_id="q", sampling_params=types.SimpleNamespace(extra_args=None, prompt_logprobs=1))]
    runner._update_states(types.SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=arriving,
                                                preempted_req_ids=set()))
    runner._update_states(types.SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[],
                                                preempted_req_ids={"p", "q"}))
    assert sorted(freed) == ["p", "q"]
    # both resumed: "p" still opted out, and "q" (prompt logprobs) too, though V1's batch lists prompt-logprob
    # requests only until their first prefill completes (the prefix-cache guard publishes q's blocks)
    runner._model_forward()
    assert seen[-1].tolist() == [True, True]
    runner._update_states(types.SimpleNamespace(finished_req_ids={"q"}, scheduled_new_reqs=[],
                                                preempted_req_ids={"q"}))
    assert freed.count("q") == 2  # once for the preemption, once more when it finished: each call once
    runner._update_states(types.SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[]))  # no field: fine
    assert hook.uninstall(Runner)


def test_runner_hook_marks_requests_that_must_keep_every_row():
    """Opt-outs: prompt logprobs (vLLM's `input_batch.num_prompt_logprobs`) and
    `extra_args={"uniprefill": False}` seen when the request arrives; none -> None."""
    from uniprefill.vllm import runner_hook as hook

    seen = []

    class Runner:
        def __init__(self):
            self.input_batch = types.SimpleNamespace(req_ids=["b", "c", "d"], num_prompt_logprobs={},
                                                     num_prompt_tokens_cpu_tensor=torch.tensor([5, 7, 9], dtype=torch.int32))

        def _update_states(self, scheduler_output):
            return None

        def _model_forward(self, input_ids=None, positions=None):
            seen.append(hook.opted_out())

    assert hook.install(Runner, hook.FinishedListeners())
    runner = Runner()
    runner._model_forward()
    runner.input_batch.num_prompt_logprobs = {"c": 5}
    arriving = [types.SimpleNamespace(req_id="d", sampling_params=types.SimpleNamespace(extra_args={"uniprefill": False})),
                types.SimpleNamespace(req_id="e", sampling_params=types.SimpleNamespace(extra_args=None))]
    runner._update_states(types.SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=arriving))
    runner._model_forward()
    runner.input_batch.num_prompt_logprobs = {}
    runner._update_states(types.SimpleNamespace(finished_req_ids={"d"}, scheduled_new_reqs=[]))
    runner._model_forward()
    assert seen[0] is None and seen[1].tolist() == [False, True, True] and seen[2] is None


def test_runner_hook_v2_supplies_requests_from_the_prepared_batch():
    """vLLM 0.26's model runner V2 (its default for Llama and Gemma-3): the forward inside
    `execute_model` sees the batch `prepare_inputs` built (ids, prefill lengths); a dummy run
    sees no step; finished and preempted requests are freed; opt-outs come from the
    arriving requests' sampling params (extra_args, prompt logprobs)."""
    import numpy as np

    from uniprefill.vllm import runner_hook as hook

    seen = []

    class RunnerV2:  # the two methods of vllm.v1.worker.gpu.model_runner.GPUModelRunner it wraps
        def __init__(self):
            self.batch = types.SimpleNamespace(req_ids=["a", "b", "c"], prefill_len_np=np.array([300, 40, 171, 0]))

        def prepare_inputs(self, scheduler_output, batch_desc):
            return self.batch

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kwargs):
            seen.append(hook.current_step())  # before the batch is prepared
            if not dummy_run:
                self.prepare_inputs(scheduler_output, None)
            step = hook.current_step()
            seen.append(None if step is None else (step.request_ids, step.num_prompt_tokens.tolist(),
                                                   None if step.opted_out is None else step.opted_out.tolist()))
            return "output"

    listeners = hook.FinishedListeners()
    freed = []

    class Listener:
        free = staticmethod(freed.append)

    listener = Listener()
    listeners.add(listener)
    assert hook.install_v2(RunnerV2, listeners) and not hook.install_v2(RunnerV2, listeners)
    runner = RunnerV2()
    plain = types.SimpleNamespace(finished_req_ids=set(), preempted_req_ids=None, scheduled_new_reqs=[])
    assert runner.execute_model(plain) == "output"
    assert seen == [None, (("a", "b", "c"), [300, 40, 171], None)] and hook.current_step() is None
    seen.clear()
    runner.execute_model(plain, dummy_run=True)
    runner.execute_model(plain, None, True)
    assert seen == [None, None, None, None]  # dummy runs: no requests, nothing drops
    seen.clear()
    arriving = [types.SimpleNamespace(req_id="b", sampling_params=types.SimpleNamespace(extra_args=None, prompt_logprobs=3)),
                types.SimpleNamespace(req_id="c", sampling_params=types.SimpleNamespace(extra_args={"uniprefill": False},
                                                                                        prompt_logprobs=None)),
                types.SimpleNamespace(req_id="a", sampling_params=types.SimpleNamespace(extra_args={}, prompt_logprobs=None))]
    runner.execute_model(types.SimpleNamespace(finished_req_ids={"x"}, preempted_req_ids={"y"},
                                               scheduled_new_reqs=arriving))
    assert seen[1][2] == [False, True, True] and sorted(freed) == ["x", "y"]
    seen.clear()
    runner.execute_model(types.SimpleNamespace(finished_req_ids={"b", "c"}, preempted_req_ids=None, scheduled_new_reqs=[]))
    assert seen[1][2] is None  # the opted-out requests finished: no mask again


def test_request_settings_from_sampling_params(caplog):
    """extra_args["uniprefill"]: {"p": x} gives the request its own p until it finishes; False
    or a bad setting (logged) keep every row; prompt logprobs opt out where read from params."""
    from uniprefill.vllm import runner_hook as hook

    def arriving(req_id, setting=None, logprobs=None):
        extra = None if setting is None else {"uniprefill": setting}
        return types.SimpleNamespace(req_id=req_id, sampling_params=types.SimpleNamespace(extra_args=extra,
                                                                                          prompt_logprobs=logprobs))

    settings = hook.RequestSettings()
    ids = ("a", "b", "c", "d", "e", "f")
    assert settings.of_step(ids) == (None, None)  # nothing live: nothing computed
    with caplog.at_level("WARNING", logger=hook.__name__):
        settings.arrive([arriving("a", {"p": 0.8}), arriving("b", False), arriving("c", {"p": 1.5}),
                         arriving("d", {"p": 0.9, "x": 1}), arriving("e", logprobs=2), arriving("f", True)])
    mask, p = settings.of_step(ids)
    assert mask.tolist() == [False, True, True, True, True, False]
    assert p[0].item() == pytest.approx(0.8) and torch.isnan(p[1:]).all()
    assert sum("keeps every row" in r.getMessage() for r in caplog.records) == 2  # c and d
    settings.finish({"a", "b", "c", "d", "e"})
    assert settings.of_step(ids) == (None, None)
    v1 = hook.RequestSettings()
    v1.arrive([arriving("f")])
    assert v1.of_step(("f",)) == (None, None) and v1.of_step(("f",), {"f": 2})[0].tolist() == [True]  # V1's batch too


def test_request_settings_in_the_servers_flat_form(caplog):
    """`vllm serve` hands `vllm_xargs` over as flat scalars (JSON false / true arrive as 0 / 1): "off" and 0
    opt out, 1 changes nothing, "uniprefill_p" sets p, and a p given both ways, or out of range, or a float
    0.0, keeps every row with a warning."""
    from uniprefill.vllm import runner_hook as hook

    def arriving(req_id, extra):
        return types.SimpleNamespace(req_id=req_id, sampling_params=types.SimpleNamespace(extra_args=extra,
                                                                                          prompt_logprobs=None))

    settings = hook.RequestSettings()
    with caplog.at_level("WARNING", logger=hook.__name__):
        settings.arrive([arriving("a", {"uniprefill": "off"}), arriving("b", {"uniprefill": 0}),
                         arriving("c", {"uniprefill_p": 0.7}), arriving("d", {"uniprefill_p": 0}),
                         arriving("e", {"uniprefill": {"p": 0.5}, "uniprefill_p": 0.6}),
                         arriving("f", {"uniprefill": 1}), arriving("g", {"uniprefill": 0.0})])
    mask, p = settings.of_step(("a", "b", "c", "d", "e", "f", "g", "h"))
    assert mask.tolist() == [True, True, False, True, True, False, True, False]
    assert p[2].item() == pytest.approx(0.7) and torch.isnan(p[[0, 1, 3, 4, 5, 6, 7]]).all()
    assert sum("keeps every row" in r.getMessage() for r in caplog.records) == 3  # d, e, g


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_runner_hook_says_whether_the_step_replays_a_full_graph(runner, monkeypatch):
    """The decode tables (`vllm.graph_decode`) are read only by a FULL CUDA graph's replay, so the hooks tell the
    runtimes which steps replay one: V2 from the `batch_desc.cg_mode` its `prepare_inputs` receives, V1 from the
    forward context it runs `_model_forward` in (a fake `vllm.forward_context` here). A mode that cannot be read
    counts as a replay (the tables are refilled, as before)."""
    import sys

    import numpy as np

    from uniprefill.vllm import runner_hook as hook

    said = []

    class Listener:
        free = staticmethod(lambda request_id: None)

        @staticmethod
        def before_step(request_ids, full_graph):
            said.append((request_ids, full_graph))

    listeners = hook.FinishedListeners()
    listener = Listener()
    listeners.add(listener)
    modes = [types.SimpleNamespace(name=name) for name in ("FULL", "PIECEWISE", "NONE")] + [None]
    if runner == "v2":
        class Runner:
            def prepare_inputs(self, scheduler_output, batch_desc):
                return types.SimpleNamespace(req_ids=["a", "b"], prefill_len_np=np.array([1, 1]))

            def execute_model(self, scheduler_output):
                return None

        assert hook.install_v2(Runner, listeners)
        for mode in modes[:3]:
            Runner().prepare_inputs(None, types.SimpleNamespace(cg_mode=mode))
        Runner().prepare_inputs(None, batch_desc=types.SimpleNamespace(cg_mode=modes[0]))  # by keyword
        Runner().prepare_inputs(None, None)
        Runner().prepare_inputs(None, types.SimpleNamespace(cg_mode=types.SimpleNamespace(name="LATER")))
        assert said == [(("a", "b"), True), (("a", "b"), False), (("a", "b"), False), (("a", "b"), True),
                        (("a", "b"), True), (("a", "b"), True)]  # a mode not known refills
        return

    class Runner:
        input_batch = types.SimpleNamespace(req_ids=["a"], num_prompt_tokens_cpu_tensor=torch.tensor([4]))

        def _update_states(self, scheduler_output):
            return None

        def _model_forward(self):
            return None

    assert hook.install(Runner, listeners)
    context = types.SimpleNamespace(cudagraph_runtime_mode=None)
    fake = types.ModuleType("vllm.forward_context")
    fake.get_forward_context = lambda: context
    fake.is_forward_context_available = lambda: context is not None
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fake)
    for mode in modes:
        context.cudagraph_runtime_mode = mode
        Runner()._model_forward()
    context = None
    Runner()._model_forward()  # no forward context: counts as a replay
    assert said == [(("a",), True), (("a",), False), (("a",), False), (("a",), True), (("a",), True)]
