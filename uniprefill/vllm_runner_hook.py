"""Request identity for uniprefill inside vLLM: which request each batch row belongs to.

vLLM 0.26 has two GPU model runners: V1 (`vllm.v1.worker.gpu_model_runner`, below) and V2
(`vllm.v1.worker.gpu.model_runner`, the default for non-MoE, non-hybrid models): `install`
wraps V1, `install_v2` wraps V2 (see its docstring); the plugin wraps both.

vLLM 0.26's forward context has per-layer attention metadata but no request ids (the H200 dump,
docs/vllm.md), and a drop history is per request. The model runner has them: while
`GPUModelRunner._model_forward` runs, `self.input_batch.req_ids` lists the step's requests in
batch order and `self.input_batch.num_prompt_tokens_cpu_tensor` their prompt lengths;
`_update_states(scheduler_output)` sees `scheduler_output.finished_req_ids`. `install(cls)`
wraps those two methods of a runner class (idempotent): the forward runs inside a
`current_step()` context (a ContextVar, like vLLM's own forward context), and finished ids are
handed to every registered `on_finished` listener (the runtimes free their histories).

Requests that must not drop (`opted_out()`): those asking for prompt logprobs (vLLM reads
the logits at every prompt position; `input_batch.num_prompt_logprobs`) and those whose
sampling params say `extra_args={"uniprefill": False}` (recorded when the request arrives,
`scheduler_output.scheduled_new_reqs`). When no live request opted out, nothing is computed
per step.

[read] in vLLM 0.26.0's source only: NOT yet run on the GPU, and private methods can change
between vLLM versions; the plugin uses it only where `UNIPREFILL_VLLM_DROP=1` asks for the
experimental vLLM rewrite (see `uniprefill.vllm_plugin`).
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from dataclasses import dataclass

import torch

_STEP: contextvars.ContextVar[StepRequests | None] = contextvars.ContextVar("uniprefill_vllm_step", default=None)
_MARK = "_uniprefill_wrapped"


@dataclass(frozen=True)
class StepRequests:
    request_ids: tuple[str, ...]  # batch order
    num_prompt_tokens: torch.Tensor  # host int64 [R]
    opted_out: torch.Tensor | None = None  # host bool [R]; None: no request of the step opted out


def current_step() -> StepRequests | None:
    """The requests of the forward running now (None outside a wrapped runner's forward)."""
    return _STEP.get()


class FinishedListeners:
    """Callbacks for finished request ids; held weakly, so a dropped runtime unregisters itself."""

    def __init__(self) -> None:
        self._listeners: weakref.WeakSet = weakref.WeakSet()

    def add(self, listener) -> None:
        """`listener.free(request_id)` is called for every finished request."""
        self._listeners.add(listener)

    def totals(self) -> list[dict]:
        """The running drop totals of every registered runtime (those that keep `totals`)."""
        import dataclasses

        return [dataclasses.asdict(listener.totals) for listener in list(self._listeners)
                if dataclasses.is_dataclass(getattr(listener, "totals", None))]

    def notify(self, request_ids) -> None:
        for listener in list(self._listeners):
            for request_id in request_ids:
                listener.free(request_id)


# Process-wide, like the runner class it wraps: the runtimes of this process's graphs.
LISTENERS = FinishedListeners()


def install(runner_cls, listeners: FinishedListeners = LISTENERS) -> bool:
    """Wrap `runner_cls._model_forward` and `_update_states`; False if already wrapped."""
    if getattr(runner_cls._model_forward, _MARK, False):
        return False
    forward, update = runner_cls._model_forward, runner_cls._update_states
    opted_out_ids: set[str] = set()  # requests whose sampling params opt out (extra_args)

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        batch = self.input_batch
        ids = tuple(batch.req_ids)
        logprobs = getattr(batch, "num_prompt_logprobs", None) or {}  # vLLM's {req_id: n}, usually empty
        mask = None
        if opted_out_ids or logprobs:
            mask = torch.tensor([r in opted_out_ids or r in logprobs for r in ids], dtype=torch.bool)
        step = StepRequests(ids, batch.num_prompt_tokens_cpu_tensor[:len(ids)].to(torch.long), mask)
        token = _STEP.set(step)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _STEP.reset(token)

    @functools.wraps(update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        finished = tuple(getattr(scheduler_output, "finished_req_ids", ()) or ())
        opted_out_ids.difference_update(finished)
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            extra = getattr(getattr(new, "sampling_params", None), "extra_args", None) or {}
            if extra.get("uniprefill") is False:
                opted_out_ids.add(new.req_id)
        listeners.notify(finished)
        return update(self, scheduler_output, *args, **kwargs)

    for wrapped in (_model_forward, _update_states):
        setattr(wrapped, _MARK, True)
    runner_cls._model_forward = _model_forward
    runner_cls._update_states = _update_states
    return True


def install_v2(runner_cls, listeners: FinishedListeners = LISTENERS) -> bool:
    """Wrap vLLM 0.26's model runner V2 (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`, the
    default there for non-MoE, non-hybrid generate models such as Llama and Gemma-3; the H200
    run of 2026-12-01 found the rewrite idle because only V1 was wrapped). False if already wrapped.

    `execute_model(scheduler_output, ..., dummy_run=False)` frees finished AND preempted
    requests (V2 drops a preempted request's state; it is prefilled anew later) and records
    opt-outs of arriving requests (`extra_args={"uniprefill": False}`, or prompt logprobs,
    which V2 reads from the sampling params); its forward runs with no step until
    `prepare_inputs(scheduler_output, batch_desc)` returns the batch: `req_ids` (batch order)
    and `prefill_len_np` (tokens the request prefills: its prompt, plus earlier outputs
    after a preemption). A dummy run never calls `prepare_inputs`: no step, nothing drops.
    """
    if getattr(runner_cls.execute_model, _MARK, False):
        return False
    execute, prepare = runner_cls.execute_model, runner_cls.prepare_inputs
    opted_out_ids: set[str] = set()

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if not kwargs.get("dummy_run", args[1] if len(args) > 1 else False):
            finished = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
            finished |= set(getattr(scheduler_output, "preempted_req_ids", ()) or ())
            opted_out_ids.difference_update(finished)
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                params = getattr(new, "sampling_params", None)
                extra = getattr(params, "extra_args", None) or {}
                if extra.get("uniprefill") is False or getattr(params, "prompt_logprobs", None) is not None:
                    opted_out_ids.add(new.req_id)
            listeners.notify(finished)
        token = _STEP.set(None)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            _STEP.reset(token)

    @functools.wraps(prepare)
    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        batch = prepare(self, scheduler_output, *args, **kwargs)
        ids = tuple(batch.req_ids)
        mask = None
        if opted_out_ids:
            mask = torch.tensor([r in opted_out_ids for r in ids], dtype=torch.bool)
        prefill = torch.as_tensor(batch.prefill_len_np[:len(ids)]).to(torch.long)
        _STEP.set(StepRequests(ids, prefill, mask))  # seen by the forward execute_model runs next
        return batch

    for wrapped in (execute_model, prepare_inputs):
        setattr(wrapped, _MARK, True)
    runner_cls.execute_model = execute_model
    runner_cls.prepare_inputs = prepare_inputs
    return True


def drop_totals(worker=None) -> list[dict]:
    """What the runtimes of this process dropped so far (one dict per compiled graph).

    Shaped for vLLM's `LLM.collective_rpc(drop_totals)`, which calls it in every worker (the
    EngineCore process, where the runtimes live) with the worker as argument; an empty list
    there means the rewrite never ran in that process."""
    return LISTENERS.totals()


def step_request_ids() -> tuple[str, ...] | None:
    """The step's request ids, or None outside a wrapped forward (vLLM's dummy and warm-up
    runs call the model directly: no requests, nothing to drop)."""
    step = current_step()
    return None if step is None else step.request_ids


def request_ids() -> tuple[str, ...]:
    step = current_step()
    if step is None:
        raise RuntimeError("uniprefill: no request ids for this forward (vLLM's model runner is not wrapped)")
    return step.request_ids


def opted_out() -> torch.Tensor | None:
    """Host bool [R]: the step's requests that must keep every row; None when none must."""
    step = current_step()
    if step is None:
        raise RuntimeError("uniprefill: no requests for this forward (vLLM's model runner is not wrapped)")
    return step.opted_out


def num_prompt_tokens() -> torch.Tensor:
    step = current_step()
    if step is None:
        raise RuntimeError("uniprefill: no prompt lengths for this forward (vLLM's model runner is not wrapped)")
    return step.num_prompt_tokens

