"""The prefix-cache guard: a request never publishes KV blocks its drop may have changed (vLLM's default
prefix caching stays on). A stand-in for vLLM 0.26's scheduler with the one call the guard wraps,
`kv_cache_manager.coordinator.cache_blocks(request, num_tokens)`; the engine-level check on real vLLM
is `test_vllm_engine_gpu.py::test_prefix_caching_stays_on_while_dropping`."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from uniprefill.vllm import prefix_cache_guard
from uniprefill.vllm.checks import BACKEND_QUALNAME


class PrefixCache:
    """What vLLM's coordinator publishes: request id -> tokens whose blocks other requests may read."""

    def __init__(self) -> None:
        self.published: dict[str, int] = {}

    def cache_blocks(self, request, num_computed_tokens):
        self.published[request.request_id] = num_computed_tokens


class Scheduler:
    """vLLM 0.26's `Scheduler.__init__(vllm_config, kv_cache_config, ...)`, reduced to its cache manager."""

    def __init__(self, vllm_config, kv_cache_config=None, *args, **kwargs):
        self.vllm_config = vllm_config
        self.kv_cache_manager = NS(coordinator=PrefixCache())

    def schedule(self, request, num_tokens):  # what allocate_slots does after each schedule when caching
        self.kv_cache_manager.coordinator.cache_blocks(request, num_tokens)


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def config(*, drop=True, caching=True, min_tokens=64, **settings):
    options = {"min_tokens": min_tokens, "vllm_drop": drop, **settings}
    return NS(compilation_config=NS(mode=2, backend=BACKEND_QUALNAME, inductor_compile_config={"uniprefill": options}),
              cache_config=NS(enable_prefix_caching=caching))


def request(name, prompt_tokens, prompt_logprobs=None, **extra_args):
    return NS(request_id=name, num_prompt_tokens=prompt_tokens,
              sampling_params=NS(extra_args=extra_args or None, prompt_logprobs=prompt_logprobs))


@pytest.fixture()
def installed():
    assert prefix_cache_guard.install(Scheduler)
    yield
    assert prefix_cache_guard.uninstall(Scheduler)


def test_a_request_that_may_drop_publishes_no_blocks(installed):
    """Fails without the guard: the long request's compacted blocks would reach the prefix cache."""
    scheduler = AsyncScheduler(config(), None)
    long, short = request("long", 500), request("short", 40)
    scheduler.schedule(long, 500)
    scheduler.schedule(long, 501)  # a decode step publishes again in vLLM: still nothing
    scheduler.schedule(short, 40)
    assert scheduler.kv_cache_manager.coordinator.published == {"short": 40}
    guard = scheduler.uniprefill_prefix_cache_guard
    assert (guard.withheld, guard.published, guard.min_tokens) == (2, 1, 256)  # min_tokens raised to sink + last_q


def test_earlier_chunks_of_a_chunked_prompt_publish_and_its_last_chunk_does_not(installed):
    """A step that schedules part of the rest of a prompt never drops (the worker's PARTIAL_CHUNK): its
    blocks publish; the step that reaches the prompt's end may drop, and it and every later step (decode,
    a preempted request's recompute) publish nothing. Fails with a guard that counts prompt lengths only
    (nothing of a long prompt would publish) or with no guard (the last chunk would publish)."""
    scheduler = Scheduler(config())
    published = scheduler.kv_cache_manager.coordinator.published
    long = request("long", 1000)
    scheduler.schedule(long, 400)  # vLLM: min(computed + new, num_tokens), chunk 1
    assert published == {"long": 400}
    scheduler.schedule(long, 800)  # chunk 2
    assert published == {"long": 800}
    for num_tokens in (1000, 1001, 1002):  # the last chunk, then decode steps
        scheduler.schedule(long, num_tokens)
        assert published == {"long": 800}
    guard = scheduler.uniprefill_prefix_cache_guard
    assert (guard.published, guard.withheld) == (2, 3)


def test_an_engine_at_p_1_publishes_as_standard_vllm_does(installed):
    """At top-p 1 with no forced keep ratio the worker keeps every block (`select_blocks`: p >= 1 keeps
    all), so nothing it computes differs from standard's blocks: the guard must not cost the engine its
    prefix-cache hits (on the H200, 2026-12-06, a p = 1 engine's second pass of 120 prompts found cached
    starts for 65 of them, standard for 120). A request that brings its own p below 1 may drop: withheld."""
    scheduler = Scheduler(config(p=1.0))
    scheduler.schedule(request("long", 500), 500)
    scheduler.schedule(request("own p", 500, uniprefill={"p": 0.9}), 500)
    scheduler.schedule(request("server p", 500, uniprefill_p=0.5), 500)
    scheduler.schedule(NS(request_id="no params", num_prompt_tokens=500), 500)  # the engine's p: 1
    assert scheduler.kv_cache_manager.coordinator.published == {"long": 500, "no params": 500}
    dropping = Scheduler(config())  # p = 0.95: a request with no sampling params takes it, and may drop
    dropping.schedule(NS(request_id="no params", num_prompt_tokens=500), 500)
    assert dropping.kv_cache_manager.coordinator.published == {}


@pytest.mark.parametrize("extra_args, publishes", [
    ({}, False),
    ({"prompt_logprobs": 0}, True),  # prompt logprobs: the worker keeps every row (not an extra_args key)
    ({"prompt_logprobs": 5, "uniprefill": {"p": 0.5}}, True),
    ({"uniprefill": False}, True),
    ({"uniprefill": "off"}, True),
    ({"uniprefill": 0}, True),  # the server's JSON false
    ({"uniprefill": True}, False),
    ({"uniprefill": {"p": 1.0}}, True),
    ({"uniprefill": {"p": 0.5}}, False),
    ({"uniprefill_p": 1}, True),
    ({"uniprefill": {"p": 2.0}}, True),  # not understood: the worker keeps every row
    ({"uniprefill": "sometimes"}, True),
    ({"prompt_logprobs": 1, "uniprefill": "sometimes"}, True),  # both: the setting's problem is still reported
])
def test_requests_that_cannot_remove_a_row_publish_and_the_worker_reads_the_same_setting(installed, extra_args, publishes):
    """Opted-out requests and requests at top-p 1 keep every row, so their blocks are standard's. The guard
    (scheduler) and `RequestSettings` (worker) read the setting with one function; this checks that what the
    worker records (opted out, or its own p) makes it keep every row exactly where the guard publishes. That a
    recorded p of 1 keeps every block is the selection's own test (`select_blocks`: p >= 1 keeps all)."""
    from uniprefill.vllm.runner_hook import RequestSettings

    scheduler = Scheduler(config())  # p = 0.95
    scheduler.schedule(request("r", 500, **extra_args), 500)
    assert ("r" in scheduler.kv_cache_manager.coordinator.published) is publishes
    extra_args = dict(extra_args)
    logprobs = extra_args.pop("prompt_logprobs", None)
    worker = RequestSettings()
    worker.arrive([NS(req_id="r", sampling_params=NS(extra_args=extra_args, prompt_logprobs=logprobs))])
    keeps_every_row = "r" in worker.opted_out or worker.p.get("r", 0.95) >= 1.0
    assert keeps_every_row is publishes


def test_a_forced_keep_ratio_ignores_a_requests_p(installed):
    """With keep_ratio the config's and the request's p are not read (the worker drops by ratio): a
    request at p = 1 still drops, so it is withheld; an opted-out one publishes."""
    scheduler = Scheduler(config(p=1.0, keep_ratio=0.3, drop_layers=[1]))
    scheduler.schedule(request("p1", 500, uniprefill={"p": 1.0}), 500)
    scheduler.schedule(request("out", 500, uniprefill=False), 500)
    assert scheduler.kv_cache_manager.coordinator.published == {"out": 500}


@pytest.mark.parametrize("drop, caching", [(False, True), (True, False)])
def test_engines_that_do_not_drop_or_do_not_cache_are_left_as_built(installed, drop, caching):
    scheduler = Scheduler(config(drop=drop, caching=caching))
    scheduler.schedule(request("long", 500), 500)
    assert scheduler.kv_cache_manager.coordinator.published == {"long": 500}
    assert not hasattr(scheduler, "uniprefill_prefix_cache_guard")


def test_the_bound_is_the_workers_effective_min_tokens(installed):
    """The worker never drops a prompt shorter than `effective_min_tokens` (min_tokens raised to at least
    sink + last_q): shorter prompts publish, longer ones do not."""
    from uniprefill.config import UniPrefillConfig

    bound = UniPrefillConfig(min_tokens=1).effective_min_tokens
    scheduler = Scheduler(config(min_tokens=1))
    scheduler.schedule(request("below", bound - 1), bound - 1)
    scheduler.schedule(request("at", bound), bound)
    assert set(scheduler.kv_cache_manager.coordinator.published) == {"below"}


def test_install_is_idempotent_and_reversible():
    original = Scheduler.__init__
    assert prefix_cache_guard.install(Scheduler) and not prefix_cache_guard.install(Scheduler)
    assert Scheduler.__init__ is not original
    assert prefix_cache_guard.uninstall(Scheduler) and not prefix_cache_guard.uninstall(Scheduler)
    assert Scheduler.__init__ is original
    unguarded = Scheduler(config())
    unguarded.schedule(request("long", 500), 500)
    assert unguarded.kv_cache_manager.coordinator.published == {"long": 500}  # what the guard prevents


def test_install_where_vllm_runs_imports_nothing_without_vllm():
    import sys

    if "vllm" in sys.modules:
        pytest.skip("vLLM is imported in this process")
    assert prefix_cache_guard.install_where_vllm_runs() is False and "vllm" not in sys.modules


def test_prompt_logprobs_opt_out_in_the_one_reader_and_a_bad_setting_beside_them_is_still_reported():
    from uniprefill.vllm.request_option import RequestOption, read_request_option

    assert read_request_option(NS(extra_args={"uniprefill": {"p": 0.5}}, prompt_logprobs=0)) == RequestOption(
        opted_out=True)
    assert read_request_option(NS(extra_args=None, prompt_logprobs=None)) == RequestOption()
    both = read_request_option(NS(extra_args={"uniprefill": "sometimes"}, prompt_logprobs=3))
    assert both.opted_out and "sometimes" in both.problem
