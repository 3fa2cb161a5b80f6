"""Request identity for uniprefill inside vLLM: which request each batch row belongs to.

vLLM 0.26 has two GPU model runners: V1 (`vllm.v1.worker.gpu_model_runner`, below) and V2
(`vllm.v1.worker.gpu.model_runner`, the default for non-MoE, non-hybrid models): `install`
wraps V1, `install_v2` wraps V2 (see its docstring); the plugin wraps both.

vLLM 0.26's forward context has per-layer attention metadata but no request ids (the H200 dump,
docs/vllm.md), and a drop history is per request. The model runner has them: while
`GPUModelRunner._model_forward` runs, `self.input_batch.req_ids` lists the step's requests in
batch order and `self.input_batch.num_prompt_tokens_cpu_tensor` their prompt lengths;
`_update_states(scheduler_output)` sees `scheduler_output.finished_req_ids` (and `preempted_req_ids`,
which vLLM 0.26's scheduler fills for either runner). `install(cls)` wraps those two methods of a runner
class (idempotent): the forward runs inside a `current_step()` context (a ContextVar, like vLLM's own
forward context), and finished and preempted ids are handed to every registered `on_finished` listener
(the runtimes free their histories: a preempted request's KV is computed anew when it resumes).

Requests that must not drop (`opted_out()`): those asking for prompt logprobs (vLLM reads
the logits at every prompt position; read from the sampling params when the request arrives, so it
holds for the request's whole life, a recompute after a preemption included, as the prefix-cache guard
assumes; V1's `input_batch.num_prompt_logprobs` is read too) and those whose
sampling params say `extra_args={"uniprefill": False}` (recorded when the request arrives,
`scheduler_output.scheduled_new_reqs`). `extra_args={"uniprefill": {"p": x}}` gives a request
its own top-p (`request_p()`); see `RequestSettings`. When no live request has a setting,
nothing is computed per step.

Why a patch: vLLM 0.26 gives a compilation backend no per-step hook that names the step's
requests (its forward context holds attention metadata only), and no callback when a request
finishes. So `install` / `install_v2` wrap two methods of a runner class: idempotent (a marker
on the wrappers), reversible (`uninstall`), and in this module only.

[read] in vLLM 0.26.0's source and run there on the H200 (runner V2, and V1 in a debugging run;
docs/vllm.md). Private methods can change between vLLM versions: the plugin uses the hook only
where the option `vllm_drop` asks for the experimental vLLM rewrite, and refuses that on an
unverified vLLM version (see `uniprefill.vllm.plugin`).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import weakref
from dataclasses import dataclass

import torch

from .request_option import read_request_option

_STEP: contextvars.ContextVar[StepRequests | None] = contextvars.ContextVar("uniprefill_vllm_step", default=None)
_MARK = "_uniprefill_wrapped"


@dataclass(frozen=True)
class StepRequests:
    request_ids: tuple[str, ...]  # batch order
    num_prompt_tokens: torch.Tensor  # host int64 [R]
    opted_out: torch.Tensor | None = None  # host bool [R]; None: no request of the step opted out
    p: torch.Tensor | None = None  # host float32 [R], a request's own p (NaN: the engine's); None: none has one


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
        """The running drop totals of every registered runtime (those that keep `totals`), each with
        `live_drop_histories`: the requests whose drop history the runtime still holds (0 once every
        request has finished or been aborted)."""
        import dataclasses

        return [dataclasses.asdict(listener.totals) | {"live_drop_histories": len(getattr(listener, "store", ()))}
                for listener in list(self._listeners) if dataclasses.is_dataclass(getattr(listener, "totals", None))]

    def before_step(self, request_ids: tuple[str, ...], full_graph: bool = True) -> None:
        """Before a step's forward or graph replay: `listener.before_step(ids, full_graph)` where defined (the
        runtimes refill what their decode CUDA graphs read, `vllm.graph_decode`, when the step replays a FULL
        graph: `full_graph`, True where the runner cannot tell)."""
        for listener in list(self._listeners):
            before = getattr(listener, "before_step", None)
            if before is not None:
                before(request_ids, full_graph)

    def notify(self, request_ids) -> None:
        for listener in list(self._listeners):
            for request_id in request_ids:
                listener.free(request_id)


# Process-wide, like the runner class it wraps: the runtimes of this process's graphs.
LISTENERS = FinishedListeners()

logger = logging.getLogger(__name__)


class RequestSettings:
    """Per-request settings of the live requests, read when a request arrives (`read_request_option`:
    False / "off" opts out, `{"p": x}` its own top-p; a setting it does not understand is logged and the
    request keeps every row, so a bad setting never silently changes an answer). Prompt logprobs opt out
    too, for the request's whole life (the prefix-cache guard, reading the same function, publishes such a
    request's blocks, so it must never drop, a recompute after a preemption included). Nothing per step is
    computed while no live request has a setting."""

    def __init__(self) -> None:
        self.opted_out: set[str] = set()
        self.p: dict[str, float] = {}

    def arrive(self, new_requests) -> None:
        for new in new_requests or ():
            option = read_request_option(getattr(new, "sampling_params", None))  # prompt logprobs opt out too
            if option.problem:
                logger.warning("uniprefill: request %s: %s; it keeps every row", new.req_id, option.problem)
            if option.opted_out:
                self.opted_out.add(new.req_id)
            elif option.p is not None:
                self.p[new.req_id] = option.p

    def finish(self, request_ids) -> None:
        self.opted_out.difference_update(request_ids)
        for request_id in request_ids:
            self.p.pop(request_id, None)

    def of_step(self, ids: tuple[str, ...], also_opted_out=()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(opted_out mask, per-request p) for the step's requests, each None when empty."""
        mask = p = None
        if self.opted_out or also_opted_out:
            mask = torch.tensor([r in self.opted_out or r in also_opted_out for r in ids], dtype=torch.bool)
        if self.p:
            p = torch.tensor([self.p.get(r, math.nan) for r in ids], dtype=torch.float32)
        return mask, p


def _v1_replays_full_graph() -> bool:
    """Whether runner V1's forward about to run replays a FULL CUDA graph: V1 sets the forward context (its
    `cudagraph_runtime_mode`) around `_model_forward`. True where that cannot be read (the decode tables are
    then refilled, as for a replay). Only a FULL replay reads the tables: eager and piecewise steps read the drop
    histories on the host, so a prefill step skips the refill (2.9-4.7 ms of host time a 21K-34K-token Gemma step on
    the H100 trace of 2026-12-06f) and the next decode step does it once."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return True
    return not is_forward_context_available() or _replays_full_graph(
        getattr(get_forward_context(), "cudagraph_runtime_mode", None))


def _replays_full_graph(mode) -> bool:
    """Whether a step run in CUDA-graph mode `mode` (vLLM's `CUDAGraphMode`, compared by name) may replay a FULL
    graph: False only for NONE and PIECEWISE, so a mode not known (None, or one a later vLLM adds) refills."""
    return getattr(mode, "name", mode) not in ("NONE", "PIECEWISE")


def install(runner_cls, listeners: FinishedListeners = LISTENERS) -> bool:
    """Wrap `runner_cls._model_forward` and `_update_states`; False if already wrapped."""
    if getattr(runner_cls._model_forward, _MARK, False):
        return False
    forward, update = runner_cls._model_forward, runner_cls._update_states
    settings = RequestSettings()

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        batch = self.input_batch
        ids = tuple(batch.req_ids)
        logprobs = getattr(batch, "num_prompt_logprobs", None) or {}  # vLLM's {req_id: n}, usually empty
        mask, p = settings.of_step(ids, logprobs)
        step = StepRequests(ids, batch.num_prompt_tokens_cpu_tensor[:len(ids)].to(torch.long), mask, p)
        listeners.before_step(ids, _v1_replays_full_graph())
        token = _STEP.set(step)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _STEP.reset(token)

    @functools.wraps(update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        finished = tuple(getattr(scheduler_output, "finished_req_ids", ()) or ())
        settings.finish(finished)
        settings.arrive(getattr(scheduler_output, "scheduled_new_reqs", ()))
        # a preempted request's KV is freed and computed anew when it resumes, perhaps over a prefix-cache hit
        # (then its recompute does not start at position 0, where `VllmDropRuntime` would see the history as
        # stale): its drop history goes now. V1 keeps the request itself (and its settings) across a preemption.
        preempted = tuple(getattr(scheduler_output, "preempted_req_ids", ()) or ())
        listeners.notify(finished + tuple(r for r in preempted if r not in finished))
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
    settings = RequestSettings()

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if not kwargs.get("dummy_run", args[1] if len(args) > 1 else False):
            finished = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
            finished |= set(getattr(scheduler_output, "preempted_req_ids", ()) or ())
            settings.finish(finished)
            settings.arrive(getattr(scheduler_output, "scheduled_new_reqs", ()))
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
        mask, p = settings.of_step(ids)
        prefill = torch.as_tensor(batch.prefill_len_np[:len(ids)]).to(torch.long)
        _STEP.set(StepRequests(ids, prefill, mask, p))  # seen by the forward execute_model runs next
        # before the forward, or the replay of a FULL graph (`batch_desc.cg_mode`, as `execute_model` reads it)
        batch_desc = kwargs.get("batch_desc", args[0] if args else None)
        listeners.before_step(ids, _replays_full_graph(getattr(batch_desc, "cg_mode", None)))
        return batch

    for wrapped in (execute_model, prepare_inputs):
        setattr(wrapped, _MARK, True)
    runner_cls.execute_model = execute_model
    runner_cls.prepare_inputs = prepare_inputs
    return True


def uninstall(runner_cls) -> bool:
    """Undo `install` or `install_v2` on `runner_cls` (the wrapped methods return to vLLM's own);
    False when neither had wrapped it."""
    undone = False
    for name in ("_model_forward", "_update_states", "execute_model", "prepare_inputs"):
        method = vars(runner_cls).get(name)
        if method is not None and getattr(method, _MARK, False):
            setattr(runner_cls, name, method.__wrapped__)
            undone = True
    return undone


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


WORKER_METHOD = "uniprefill_drop_totals"


def install_worker_method(worker_cls) -> bool:
    """Give vLLM's worker class the method `uniprefill_drop_totals` (`drop_totals`), so that the totals
    can be asked for by name: `LLM.collective_rpc("uniprefill_drop_totals")`, or `vllm serve`'s
    developer endpoint (`VLLM_SERVER_DEV_MODE=1`, `POST /collective_rpc {"method": "uniprefill_drop_totals"}`),
    which sends no function. Adds a method, wraps nothing; False where the class has one already."""
    if hasattr(worker_cls, WORKER_METHOD):
        return False
    setattr(worker_cls, WORKER_METHOD, drop_totals)
    return True


def collect_drop_totals(llm) -> list | str:
    """`drop_totals` of every worker of a `vllm.LLM`, printed: by name where the rewrite installed the
    worker method, else as a function (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1); what went wrong
    instead, as text, if neither works."""
    try:
        totals = llm.collective_rpc(WORKER_METHOD, timeout=60)
    except TimeoutError as exc:
        totals = f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"
    except Exception:  # noqa: BLE001 - no such method in that worker: send the function
        try:
            totals = llm.collective_rpc(drop_totals, timeout=60)
        except Exception as exc:  # noqa: BLE001 - evidence for a run's log, never a reason to fail it
            totals = f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"
    print(f"drop totals: {totals}", flush=True)
    return totals


def request_p() -> torch.Tensor | None:
    """Host float32 [R]: each request's own p (NaN: the engine's); None when none has one."""
    step = current_step()
    if step is None:
        raise RuntimeError("uniprefill: no requests for this forward (vLLM's model runner is not wrapped)")
    return step.p


def num_prompt_tokens() -> torch.Tensor:
    step = current_step()
    if step is None:
        raise RuntimeError("uniprefill: no prompt lengths for this forward (vLLM's model runner is not wrapped)")
    return step.num_prompt_tokens

