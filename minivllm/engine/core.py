"""EngineCore: the loop that ties scheduler, KV cache manager and model together.

One call to :meth:`EngineCore.step` is one iteration of continuous batching:

    schedule  ->  run the model on the packed batch (the executor)  ->  append tokens,
              check stops  ->  each request's new token ids (``EngineCoreOutput``)
              ->  record the step in the trace
              (->  propose drafts for the next step, with speculative decoding on:
                   minivllm.spec_decode.drafter)

Requests may be added or aborted between any two steps; that is what makes the batching
*continuous*. With ``async_scheduling=True`` the parts overlap instead: each call runs
one step's forward pass while a second thread processes the step before and schedules
the step after (``EngineCore._step_async``, ``minivllm.core.async_scheduler``).

The core deals in token ids only: text, stop strings and logprob dicts are
the front end's (``minivllm.engine.output_processor``). :class:`~minivllm.engine.llm_engine.LLMEngine` is
this core with that front end in the same process (``LLM`` and the thread server use
it); the engine core process of ``minivllm serve`` runs this class alone
(``minivllm.engine.core_proc``), and its server makes the text.

A request's state lives here in two places, each freed when it finishes: the
scheduler's ``Request`` (its counts and blocks) and the model runner's random generator
(when it has a seed).

In vLLM: ``vllm/v1/engine/core.py`` (``EngineCore``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.config import EngineConfig, SpeculativeConfig, load_component
from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.kv_cache_utils import KVCacheSize, size_kv_cache
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.distributed.kv_transfer import make_kv_connector
from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1
from minivllm.engine.output_processor import EngineCoreOutput, FrontEndFinish
from minivllm.engine.processor import ProcessedPrompt, check_priority
from minivllm.exceptions import ValidationError
from minivllm.executor.abstract import Executor, UniProcExecutor, load_model_for
from minivllm.executor.multiproc_executor import MultiprocExecutor, StepTiming
from minivllm.metrics import EngineStats, LoggingStatLogger, Metric, RequestMetrics, SchedulerStats
from minivllm.request import Request, RequestStatus
from minivllm.sample.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.drafter import Drafter
from minivllm.trace import StepTimes, Trace, make_step_record
from minivllm.worker.model_runner import (
    ModelRunner,
    ModelRunnerOutput,
    StepInputs,
    kv_cache_bytes_per_token,
    kv_cache_shape,
)

logger = logging.getLogger("minivllm")


@dataclass
class InFlightStep:
    """A scheduled step, until its output is processed."""
    scheduler_output: SchedulerOutput
    start: float
    """When it was scheduled (the engine's clock)."""
    scheduled: float
    """When its scheduling was done (its inputs are packed next)."""
    inputs: StepInputs | None = None
    """Async scheduling: its inputs, packed when it was scheduled (None: the step ran at once)."""
    first_time: list[Request] = field(default_factory=list)
    """The requests first scheduled in it (their timestamp goes if it is rolled back)."""


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        clock: Callable[[], float] = time.perf_counter,
        model_runner: ModelRunner | None = None,
    ) -> None:
        """Build the core in three parts: resolve the device, dtype and backends and load
        the model (``minivllm.executor.abstract.load_model_for``); size the KV cache
        (``core.kv_cache_utils.size_kv_cache``); wire the KV cache manager, scheduler, executor and
        trace together.

        ``model_runner``: a runner to use instead of building a :class:`ModelRunner`
        (which allocates the KV cache); the simulator passes its cost-model runner here.
        ``clock`` is the source of every timestamp (the simulator's is virtual).
        """
        config.verify()  # again: fields may have been changed since it was made
        self.config = config
        self.clock = clock
        loaded = load_model_for(config, model, tokenizer)
        self.model, self.tokenizer, self.device, self.dtype = loaded.model, loaded.tokenizer, loaded.device, loaded.dtype
        self.attention_backend_cls, self.attention_backend = loaded.attention_backend_cls, loaded.attention_backend
        self.linear_plan, self.linear_backend = loaded.linear_plan, loaded.linear_plan.name
        self.compilation = loaded.compilation
        """How the model is compiled (None: eager; ``minivllm.compilation``)."""
        self.eos_token_id = loaded.eos_token_id
        self.quantization = loaded.quantization
        """What ``quantization`` converted, and the weight bytes before and after (None: none)."""
        self.kv_cache_quantization = loaded.kv_cache
        """An 8-bit KV cache's dtype and per-layer scales (None: the model's dtype)."""
        self.kv_cache_dtype = loaded.kv_cache.dtype if loaded.kv_cache else self.dtype
        """The dtype the KV cache is stored in."""
        model_max_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        size = size_kv_cache(
            config, kv_cache_bytes_per_token(self.model, self.kv_cache_dtype, config.tensor_parallel_size),
            model_max_len)
        self.max_model_len = size.max_model_len
        # A model loaded here by name can be loaded by name on another machine too.
        self._wire(size, model_runner, config.model if model is None else None)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s). Maximum concurrency for "
            "%d tokens per request: %.2fx. Attention backend: %s, linear backend: %s, on %s, %s.%s",
            size.num_blocks, config.block_size, size.num_blocks * size.block_bytes / 2**20,
            size.num_tokens, self.kv_cache_dtype, self.max_model_len,
            size.num_tokens / self.max_model_len, self.attention_backend, self.linear_backend,
            self.device, "eager" if self.compilation is None else f"compiled ({self.compilation.backend})",
            "" if self.quantization is None else " " + self.quantization.describe())

    def _wire(self, size: KVCacheSize, model_runner: ModelRunner | None, model_name: str | None) -> None:
        config = self.config
        # The classes come through the build-it-yourself hook (config.COMPONENT_FIELDS):
        # the project's own by default, a learner's when one is given.
        kv_cache_manager_cls = load_component("kv_cache_manager_cls", config.kv_cache_manager_cls)
        scheduler_cls = load_component("scheduler_cls", config.scheduler_cls)
        if config.async_scheduling:
            scheduler_cls = self._async_scheduler_cls(scheduler_cls, model_runner)
        self.kv_cache_manager = kv_cache_manager_cls(
            size.num_blocks, config.block_size, config.enable_prefix_caching,
            block_pool_cls=load_component("block_pool_cls", config.block_pool_cls))
        self.kv_connector: KVConnectorBase_V1 | None = None
        """Where KV blocks come from and go to besides this engine's cache (None: nowhere)."""
        if config.kv_transfer_config is not None:
            self.kv_connector = make_kv_connector(
                config, self.kv_cache_manager, self.model, kv_cache_shape(self.model.config),
                self.kv_cache_dtype, self.kv_cache_quantization, simulated=model_runner is not None)
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            **({} if self.kv_connector is None else {"kv_connector": self.kv_connector}),
        )
        make_runner = functools.partial(
            ModelRunner, self.model, self.kv_cache_manager, self.attention_backend_cls, self.device,
            self.dtype, config.seed, linear_plan=self.linear_plan,
            sampler_cls=load_component("sampler_cls", config.sampler_cls),
            kv_cache_quantization=self.kv_cache_quantization,
            **({} if self.kv_connector is None else {"kv_connector": self.kv_connector}),
            **({} if self.compilation is None else {"compilation": self.compilation}))
        self.executor: Executor
        """Runs each step's model work: in this process, or over tensor-parallel workers."""
        if model_runner is None and config.tensor_parallel_size > 1:
            num_layers, num_kv_heads, head_dim = kv_cache_shape(self.model.config,
                                                                config.tensor_parallel_size)
            executor_args = (self.model, config.tensor_parallel_size, self.device, self.dtype,
                             self.attention_backend_cls,
                             (size.num_blocks, config.block_size, num_kv_heads, head_dim),
                             num_layers, self.linear_plan, make_runner)
            if config.distributed_executor_backend == "ray":  # imports Ray only now
                from minivllm.executor.ray_distributed_executor import RayDistributedExecutor

                self.executor = RayDistributedExecutor(*executor_args, model_name=model_name)
            else:
                self.executor = MultiprocExecutor(*executor_args)
        else:
            self.executor = UniProcExecutor(model_runner or make_runner())
        self.model_runner = self.executor.model_runner
        """The runner in this process (rank 0's with tensor parallelism)."""
        self.trace = Trace(
            block_size=config.block_size,
            num_blocks=size.num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_steps=config.max_trace_steps,
        )
        self._grammar_compiler: GrammarCompiler | None = None
        """Structured output's compiler (and its cache), made at the first request that asks for one."""
        self._finished_outputs: list = []
        """Final outputs of requests aborted between steps, handed out by the next step()."""
        self._step_index = 0
        # Async scheduling's steps in flight (:meth:`_step_async`), and its second thread.
        self._next_step: InFlightStep | None = None
        """Scheduled and packed: runs in the next call."""
        self._last_step: tuple[InFlightStep, ModelRunnerOutput] | None = None
        """Ran: its output is processed in the next call."""
        self._bookkeeper: ThreadPoolExecutor | None = None
        self.stats = EngineStats()
        """Engine-wide counters and histograms behind :meth:`get_metrics`."""
        self.drafter: Drafter | None = None
        """Speculative decoding's drafts and their metrics (``minivllm.spec_decode``); None when off."""
        if config.speculative_config is not None:
            self.drafter = Drafter(SpeculativeConfig.parse(config.speculative_config), self.max_model_len)
            self.stats.spec_decoding = self.drafter.stats
        self._stat_logger = (
            LoggingStatLogger(config.log_stats_interval, self.clock())
            if config.log_stats_interval else None
        )

    def _async_scheduler_cls(self, scheduler_cls: type, model_runner: ModelRunner | None) -> type:
        """The scheduler for async scheduling: :class:`AsyncScheduler`, or a learner's
        scheduler that is one. Refused, naming the field, for a scheduler that is not
        (it would schedule tokens it cannot know) and for a runner of one's own (the
        simulator's steps follow a virtual clock, one after the other)."""
        if model_runner is not None:
            raise ValidationError("async_scheduling", "async_scheduling needs the engine's own model "
                                  "runner (this engine was given one: the simulator's?)", True)
        if scheduler_cls is Scheduler:
            return AsyncScheduler
        if not issubclass(scheduler_cls, AsyncScheduler):
            raise ValidationError("scheduler_cls", f"async_scheduling needs a scheduler that keeps "
                                  f"placeholders (a subclass of AsyncScheduler); {scheduler_cls.__name__} "
                                  "is not", scheduler_cls)
        return scheduler_cls

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> Request:
        """Queue one request whose prompt and params the front end has checked
        (``minivllm.engine.processor``). What only the core can check is checked here, and
        refused with a :class:`~minivllm.exceptions.ValidationError` before anything is
        queued: an id in use, a priority its policy does not take, a grammar that does
        not compile."""
        if request_id in self.scheduler.requests:
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use", request_id)
        priority = check_priority(priority, self.config.scheduling_policy)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._new_grammar_state(params.structured_outputs)
        request = Request(request_id, prompt.prompt_token_ids, params,
                          self.clock() if arrival_time is None else arrival_time,
                          self.eos_token_id, prompt.prompt, priority, prompt.cache_salt)
        request.grammar = grammar
        self.scheduler.add_request(request)
        self.trace.requests[request_id] = request.metrics
        return request

    def _new_grammar_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A matcher for a new request with structured output (``minivllm.sample.structured_output``),
        compiled for this engine's tokenizer and the model's vocabulary (once per grammar:
        the compiler caches). The end-of-sequence token is the engine's own."""
        if self.tokenizer is None:
            raise ValidationError("structured_outputs", "structured output needs the engine's "
                                  "tokenizer (the grammar is over text), and this engine has none",
                                  params.kind)
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                                     self.eos_token_id)
        return self._grammar_compiler.new_state(params)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort unfinished requests now and free their blocks; their final outputs
        (finish_reason "abort") are handed out by the next ``step()``. Unknown ids raise
        KeyError and abort nothing."""
        unknown = [i for i in request_ids if i not in self.scheduler.requests]
        if unknown:
            raise KeyError(f"no unfinished request with id(s) {unknown}")
        aborted = [self.scheduler.requests[i] for i in request_ids]
        self._finish_between_steps(aborted, RequestStatus.FINISHED_ABORTED)
        outputs = [EngineCoreOutput(r.request_id, [], "abort", num_cached_tokens=r.metrics.num_cached_tokens)
                   for r in aborted]
        self._finished_outputs.extend(self._process_outputs(outputs, aborted))

    def finish_requests(self, finishes: list[FrontEndFinish]) -> None:
        """Finish requests that the API server's output processor ended (a stop string, or
        text it could not make) while this engine core still ran them; those already
        finished here meanwhile are left as they are. Its outputs are not handed out
        again: the server has made them."""
        requests = []
        for f in finishes:
            request = self.scheduler.requests.get(f.request_id)
            if request is not None:
                request.stop_reason, request.error = f.stop_reason, f.error
                requests.append((request, f.finish_reason))
        for reason in ("stop", "error"):
            self._finish_between_steps([r for r, why in requests if why == reason],
                                       RequestStatus.FINISHED_STOPPED if reason == "stop"
                                       else RequestStatus.FINISHED_ERROR)

    def _finish_between_steps(self, requests: list[Request], status: RequestStatus) -> None:
        """Finish unfinished requests now, with ``status``, and free their blocks."""
        now = self.clock()
        for request in requests:
            self.scheduler.finish_request(request, status)
            request.metrics.finished_time = now
            self.stats.record_finished(request.metrics, request.finish_reason)
        self.executor.remove_requests([r.request_id for r in requests])

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._finished_outputs)
                or self.has_steps_in_flight())

    def has_steps_in_flight(self) -> bool:
        """Async scheduling: whether a step is scheduled or run and its output not yet
        processed (the next ``step()`` does). Never without it."""
        return self._next_step is not None or self._last_step is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one iteration; return an output for every request that progressed: its new
        token ids (a ``RequestOutput`` from :class:`~minivllm.engine.llm_engine.LLMEngine`).

        Isolation: a failure that belongs to one request (its sampling, its
        detokenization) finishes that request alone, with finish_reason "error" and the
        message in ``outputs[0].error``. A failure of the forward pass, which the whole
        batch shares, is rolled back (``Scheduler.rollback``) and re-raised: the engine is
        then exactly as before the step, and stepping again retries it.
        """
        outputs, self._finished_outputs = self._finished_outputs, []
        try:
            outputs += self._step()
        except BaseException:  # hand the aborted requests' outputs out next time
            self._finished_outputs = outputs + self._finished_outputs
            raise
        return outputs

    def _step(self) -> list:
        if self.config.async_scheduling:
            return self._step_async()
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            self._empty_step(scheduler_output, start)
            return []
        scheduled = self.clock()
        result = self._execute(scheduler_output, start)
        return self._update(InFlightStep(scheduler_output, start, scheduled), result, self.clock())

    def _step_async(self) -> list:
        """One call with async scheduling: run the step packed last time, and meanwhile,
        in the engine's second thread, process the output of the step before it and
        schedule the step after it; then pack that one, here. Returns the outputs
        processed, one call late. After an idle spell the step to run is scheduled
        first, here.

        All tensor work stays in *this* thread, the one that runs the model without
        async scheduling too: PyTorch runs its CPU operators on a team of threads per
        calling thread (OpenMP), and a second team on the same cores was measured to make
        the forward pass 1.7x slower. The second thread runs only Python, and Python runs
        one thread at a time (the interpreter lock): it gets its turn when this thread
        enters an operator, and on a CPU that is mostly before the forward pass has
        started (notebook 11 measures it). On a CPU the forward pass keeps every core busy
        anyway; the overlap pays where the model runs elsewhere, on a GPU.

        A failed step is rolled back with the step scheduled behind it (whose
        placeholders stood for its tokens), and the error re-raised, as :meth:`step`
        promises; the outputs processed meanwhile are handed out by the next call."""
        if self._next_step is None and self._last_step is None:  # idle: nothing in flight
            start = self.clock()
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                self._empty_step(scheduler_output, start)
                return []
            self._next_step = self._prepare(scheduler_output, start, self.clock())
        current, last = self._next_step, self._last_step
        self._next_step = self._last_step = None
        if self._bookkeeper is None:
            self._bookkeeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-engine")
        job = self._bookkeeper.submit(self._process_and_schedule, last)
        try:
            result = None if current is None else self.executor.execute_step(current.inputs)
        except BaseException:  # an error, or Ctrl-C in a notebook: undo the step behind, then this one
            self._abandon(job)
            if current is not None:
                self._roll_back(current.scheduler_output, current.first_time)
            raise
        if current is not None:
            self._last_step = (current, result)
        try:
            outputs, scheduled = job.result()
        except BaseException:  # Ctrl-C while waiting for the engine's thread
            self._abandon(job)
            raise
        if scheduled is not None:
            try:
                self._next_step = self._prepare(*scheduled)
            except BaseException:
                self._finished_outputs.extend(outputs)
                raise
        return outputs

    def _abandon(self, job: Future) -> None:
        """``step()`` is raising: once the engine's second thread is done, hand its outputs
        out with the next call and undo the step it scheduled (placeholders for tokens
        that will not come, or that the next call schedules again)."""
        if job.exception() is not None:  # (waits) it failed itself, half-way: say so, undo nothing
            logger.error("the engine's second thread failed too", exc_info=job.exception())
            return
        outputs, scheduled = job.result()
        self._finished_outputs.extend(outputs)
        if scheduled is not None:
            self.scheduler.rollback(scheduled[0])

    def _process_and_schedule(self, last: tuple[InFlightStep, ModelRunnerOutput] | None
                              ) -> tuple[list, tuple[SchedulerOutput, float, float] | None]:
        """The engine's side of an async step (its second thread; no tensors): the
        output of the step that ran last, then the next step scheduled (with when it
        began and ended)."""
        outputs = [] if last is None else self._update(*last, self.clock())
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.preempted:
                self._record_preemptions(scheduler_output, start)
            return outputs, None
        return outputs, (scheduler_output, start, self.clock())

    def _prepare(self, scheduler_output: SchedulerOutput, start: float, scheduled: float) -> InFlightStep:
        """Pack a scheduled step's inputs to run later; if that fails, it is rolled back."""
        first_time = self._first_scheduled(scheduler_output, start)
        try:
            inputs = self.executor.prepare_step(scheduler_output)
        except BaseException:
            self._roll_back(scheduler_output, first_time)
            raise
        return InFlightStep(scheduler_output, start, scheduled, inputs, first_time)

    def _empty_step(self, scheduler_output: SchedulerOutput, start: float) -> None:
        """A step that schedules nothing (and, with async scheduling, nothing is in flight)."""
        if scheduler_output.preempted:  # memory ran out and every running request left
            self._record_preemptions(scheduler_output, start)
        if getattr(self.scheduler, "waiting_for_remote_kvs", None):  # background loads only
            self._wait_for_remote_kvs(scheduler_output)
        elif not scheduler_output.preempted and self.scheduler.has_unfinished_requests():
            raise RuntimeError("scheduler made no progress with requests pending; this is a bug")

    def _update(self, step: InFlightStep, result: ModelRunnerOutput, output_start: float) -> list:
        """A step's output into the requests: tokens, stops, logprobs, timestamps, the
        trace and the stats (and drafts for the next step)."""
        scheduler_output, start = step.scheduler_output, step.start
        accepted = self.drafter.count_accepted(scheduler_output, result.sampled) if self.drafter else {}
        before = {s.request.request_id: (s.request.num_output_tokens, len(s.request.prompt_logprobs or ()))
                  for s in scheduler_output.scheduled}
        updated = self.scheduler.update_from_output(scheduler_output, result)
        self._attach_logprobs(scheduler_output, result)
        outputs = self._process_outputs([self._core_output(r, *before[r.request_id]) for r in updated],
                                        updated)
        finished, got_token = self._record_tokens(updated)
        self.executor.remove_requests(finished)
        model_start = None
        if result.model_start is not None:  # the runner's perf_counter, on the engine's clock
            since = time.perf_counter() - result.model_start
            model_start = self.clock() - since
        self._record(scheduler_output, start, self.clock(), result.model_time, finished, accepted,
                     getattr(result, "parallel", None),
                     StepTimes(step.scheduled, model_start, output_start))
        self.stats.record_step(scheduler_output.num_scheduled_tokens, len(scheduler_output.preempted),
                               [m for m, _ in got_token], [n for _, n in got_token])
        if self.drafter is not None:
            self.drafter.observe_step(sum(n for _, n in got_token), result.model_time,
                                      not any(s.is_prefill for s in scheduler_output.scheduled))
            self.drafter.propose(updated, len(self.scheduler.running))
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self.clock(), self.stats, self.scheduler_stats())
        return outputs

    def _wait_for_remote_kvs(self, scheduler_output: SchedulerOutput) -> None:
        """Nothing to compute: every request left waits for a KV connector's background
        load. Run the connector alone (it starts the loads just scheduled and reports the
        ones that arrived), and if none has, pause a millisecond rather than spin."""
        scheduler_output.kv_connector_metadata = self.kv_connector.build_connector_meta(scheduler_output)
        result = self.executor.execute_model(scheduler_output)
        self.scheduler.update_from_output(scheduler_output, result)
        if not result.kv_connector_output.finished_recving:
            time.sleep(0.001)

    def _record_preemptions(self, scheduler_output: SchedulerOutput, start: float) -> None:
        """A step that only preempted: the running requests could not grow, and the blocks
        they held are what let the next step admit (with a KV connector, requests whose
        loaded KV has arrived hold their blocks while they wait to be admitted, so a
        lone running request can run out of room). Nothing is computed; the preemptions
        are counted and the step is in the trace like any other."""
        self._record(scheduler_output, start, self.clock(), 0.0, [], {})
        self.stats.num_preemptions += len(scheduler_output.preempted)

    def _execute(self, scheduler_output: SchedulerOutput, start: float) -> ModelRunnerOutput:
        """The forward pass and sampling; if they fail, the step is rolled back."""
        first_time = self._first_scheduled(scheduler_output, start)
        try:
            return self.executor.execute_model(scheduler_output)
        except BaseException:  # an error, or Ctrl-C in a notebook: leave nothing half-done
            self._roll_back(scheduler_output, first_time)
            raise

    @staticmethod
    def _first_scheduled(scheduler_output: SchedulerOutput, start: float) -> list[Request]:
        """Stamp the requests scheduled for the first time; returns them."""
        first_time = [s.request for s in scheduler_output.scheduled
                      if s.request.metrics.first_scheduled_time is None]
        for request in first_time:
            request.metrics.first_scheduled_time = start
        return first_time

    def _roll_back(self, scheduler_output: SchedulerOutput, first_time: list[Request]) -> None:
        """Undo a step that failed (``Scheduler.rollback``)."""
        self.scheduler.rollback(scheduler_output)
        for request in first_time:  # all were admitted this step, and are waiting again
            request.metrics.first_scheduled_time = None

    def _core_output(self, request: Request, num_sent: int, num_prompt_logprobs: int) -> EngineCoreOutput:
        """What ``request`` gained this step, given how many output tokens and prompt
        logprob entries it had before: new token ids, their logprob entries (compact:
        no text), its prompt logprobs once the whole prompt has run, how it ended."""
        new_logprobs = prompt_logprobs = None
        if request.logprobs is not None:
            new_logprobs = request.logprobs[num_sent:request.num_output_tokens]
        n = request.num_prompt_tokens
        if request.prompt_logprobs is not None and num_prompt_logprobs < n <= len(request.prompt_logprobs):
            prompt_logprobs = [None] + request.prompt_logprobs[1:n]
        return EngineCoreOutput(request.request_id, request.output_token_ids[num_sent:],
                                request.finish_reason, request.stop_reason, request.error,
                                request.metrics.num_cached_tokens, new_logprobs, prompt_logprobs)

    def _record(self, scheduler_output: SchedulerOutput, start: float, end: float, model_time: float,
                finished: list[str], accepted: dict[str, int], parallel: StepTiming | None = None,
                times: StepTimes | None = None) -> None:
        """Append the step just run to the trace (``minivllm.trace.make_step_record``); its
        ``end`` was read before, so the copying here is not in the step's duration."""
        self.trace.record(make_step_record(
            self._step_index, scheduler_output, self.scheduler, self.kv_cache_manager, start, end,
            model_time, finished, accepted, parallel, times))
        self._step_index += 1

    def _process_outputs(self, outputs: list[EngineCoreOutput], updated: list[Request]) -> list:
        """What the step hands out. Here: the token ids as they are. A front end in the
        same process (``LLMEngine``) makes its text here, before anything is counted."""
        return outputs

    def _record_tokens(self, updated: list[Request]) -> tuple[list[str], list[tuple[RequestMetrics, int]]]:
        """Timestamps of the requests that got tokens (or an error) this step. Returns
        the ids that finished and, for those that got tokens, their metrics and how many
        tokens (several only with speculative decoding; they share one timestamp)."""
        now = self.clock()
        finished: list[str] = []
        got_token: list[tuple[RequestMetrics, int]] = []
        for request in updated:
            m = request.metrics
            num_new = request.num_output_tokens - len(m.token_times)
            if num_new > 0:
                got_token.append((m, num_new))
                m.token_times.extend([now] * num_new)
                if m.first_token_time is None:
                    m.first_token_time = now
            if request.is_finished:
                m.finished_time = now
                finished.append(request.request_id)
                self.stats.record_finished(m, request.finish_reason)
        return finished, got_token

    def _attach_logprobs(self, scheduler_output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Append this step's logprobs to the requests that asked. Tokens after a stop
        (a stop token among accepted drafts) were not kept: neither are their entries."""
        for s in scheduler_output.scheduled:
            request = s.request
            if request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, []))
            if request.logprobs is not None:
                request.logprobs.extend(result.logprobs.get(request.request_id, []))
                del request.logprobs[request.num_output_tokens:]

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- metrics ------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler and KV cache as they are now (the gauges of :meth:`get_metrics`)."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            # vLLM counts requests waiting for a background KV load as waiting too
            num_waiting_reqs=len(self.scheduler.waiting) + len(getattr(self.scheduler, "waiting_for_remote_kvs", ())),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and let the KV connector keep what
        should outlive the engine (idempotent)."""
        if getattr(self, "executor", None) is not None:  # None: __init__ failed before it
            self.executor.shutdown()
        if getattr(self, "_bookkeeper", None) is not None:
            self._bookkeeper.shutdown(wait=True)
            self._bookkeeper = None
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.shutdown()

    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms named like vLLM's (``minivllm:`` prefix)."""
        connector = [] if self.kv_connector is None else self.kv_connector.get_metrics()
        return self.stats.get_metrics(self.scheduler_stats()) + connector

