"""LLMEngine: the loop that ties scheduler, block manager and model runner together.

One call to :meth:`LLMEngine.step` is one iteration of continuous batching:

    schedule  ->  run the model on the packed batch  ->  append tokens, check stops
              ->  new token ids per request (EngineCoreOutput)
              ->  text, stop strings, logprobs: the OutputProcessor -> RequestOutputs
              ->  record the step in the trace
              (->  propose drafts for the next step, with speculative decoding on:
                   minivllm.spec_decode.drafter)

Requests may be added or aborted between any two steps; that is what makes the batching
*continuous*. Streaming is just calling ``step()`` and reading each output's
``new_text`` (``LLM.stream`` does exactly that).

A request's state lives in three places, each freed when it finishes: the scheduler's
``Request`` (its counts and blocks), the output processor's ``RequestState`` (its text and
stop strings, ``minivllm.output_processor``) and the model runner's random generator
(when it has a seed). The engine core of ``minivllm serve`` is this class built with
``output_processing=False``: it hands out token ids, and the API server's own
``OutputProcessor`` makes the text.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.attention import BACKEND_CLASSES, BACKENDS, resolve_backend
from minivllm.config import (
    DTYPES,
    EngineConfig,
    KVCacheSize,
    SpeculativeConfig,
    load_component,
    resolve_device,
    size_kv_cache,
)
from minivllm.core.scheduler import SchedulerOutput, check_priority
from minivllm.distributed.executor import MultiprocExecutor, StepTiming
from minivllm.distributed.tensor_parallel import check_tensor_parallel_size
from minivllm.exceptions import ValidationError, ValidationTypeError, check_float
from minivllm.executor import Executor, UniProcExecutor
from minivllm.linear import choose_linear_plan, resolve_linear_backend
from minivllm.metrics import EngineStats, LoggingStatLogger, Metric, RequestMetrics, SchedulerStats
from minivllm.model_loader import load_model
from minivllm.model_runner import (
    ModelRunner,
    ModelRunnerOutput,
    kv_cache_bytes_per_token,
    kv_cache_shape,
)
from minivllm.output_processor import EngineCoreOutput, FrontEndFinish, OutputProcessor
from minivllm.outputs import RequestOutput
from minivllm.parallel_sampling import ParentRequest, ParentRequests
from minivllm.processor import ProcessedPrompt, Processor
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.drafter import Drafter
from minivllm.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from minivllm.trace import ScheduledChunk, StepRecord, Trace

logger = logging.getLogger("minivllm")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        clock: Callable[[], float] = time.perf_counter,
        model_runner: ModelRunner | None = None,
        output_processing: bool = True,
    ) -> None:
        """Build the engine in three parts: resolve the device, dtype and backends and
        load the model; size the KV cache (``config.size_kv_cache``); wire the KV cache
        manager, scheduler, model runner and trace together.

        ``model_runner``: a runner to use instead of building a :class:`ModelRunner`
        (which allocates the KV cache); the simulator passes its cost-model runner here.
        ``clock`` is the source of every timestamp (the simulator's is virtual).
        ``output_processing=False``: :meth:`step` returns each request's new token ids
        (``EngineCoreOutput``) instead of ``RequestOutput``; the engine core process
        (``minivllm.engine_core``) is built so, its server makes the text.
        """
        config.verify()  # again: fields may have been changed since it was made
        self.config = config
        self.clock = clock
        self._resolve(model, tokenizer)
        model_max_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        size = size_kv_cache(
            config, kv_cache_bytes_per_token(self.model, self.dtype, config.tensor_parallel_size),
            model_max_len)
        self.max_model_len = size.max_model_len
        self._wire(size, model_runner, output_processing)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens). Maximum concurrency for "
            "%d tokens per request: %.2fx. Attention backend: %s, linear backend: %s, on %s.",
            size.num_blocks, config.block_size, size.num_blocks * size.block_bytes / 2**20,
            size.num_tokens, self.max_model_len, size.num_tokens / self.max_model_len,
            self.attention_backend, self.linear_backend, self.device,
        )

    def _resolve(self, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """Device, dtype and backends from the config; the model (loaded when not given)."""
        config = self.config
        self.dtype = DTYPES[config.dtype]
        self.device = resolve_device(config.device)
        spec = config.attention_backend
        if isinstance(spec, str) and spec in BACKENDS:
            try:
                spec = BACKEND_CLASSES[resolve_backend(spec, self.device)]
            except (ValueError, RuntimeError) as e:
                raise ValidationError("attention_backend", str(e), config.attention_backend) from None
        # Through the build-it-yourself hook, like the classes of _wire.
        self.attention_backend_cls = load_component("attention_backend", spec)
        # Its name ("torch", "triton") for logs and benchmark records; a learner's class
        # that names none is called by its class name.
        cls = self.attention_backend_cls
        self.attention_backend = getattr(cls, "name", None) or cls.__name__
        try:
            self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        except ValueError as e:
            raise ValidationError("linear_backend", str(e), config.linear_backend) from None
        loaded_here = model is None
        if loaded_here:
            model, tokenizer = load_model(config.model, self.dtype, self.device)
        if config.tensor_parallel_size > 1:
            try:
                check_tensor_parallel_size(model.config, config.tensor_parallel_size)
            except ValueError as e:
                raise ValidationError("tensor_parallel_size", str(e), config.tensor_parallel_size) from None
        if not loaded_here:
            if config.tensor_parallel_size > 1:  # sharding changes it in place: not the caller's
                model = copy.deepcopy(model)
            model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model = model
        self.tokenizer = tokenizer
        # "auto" becomes a plan measured on this machine (or read from its cache).
        self.linear_plan = choose_linear_plan(self.linear_backend, model)
        self.linear_backend = self.linear_plan.name
        self.eos_token_id = eos_token_id(model, tokenizer)

    def _wire(self, size: KVCacheSize, model_runner: ModelRunner | None, output_processing: bool) -> None:
        config = self.config
        # The classes come through the build-it-yourself hook (config.COMPONENT_FIELDS):
        # the project's own by default, a learner's when one is given.
        kv_cache_manager_cls = load_component("kv_cache_manager_cls", config.kv_cache_manager_cls)
        scheduler_cls = load_component("scheduler_cls", config.scheduler_cls)
        self.kv_cache_manager = kv_cache_manager_cls(
            size.num_blocks, config.block_size, config.enable_prefix_caching,
            block_pool_cls=load_component("block_pool_cls", config.block_pool_cls))
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        make_runner = functools.partial(
            ModelRunner, self.model, self.kv_cache_manager, self.attention_backend_cls, self.device,
            self.dtype, config.seed, linear_plan=self.linear_plan,
            sampler_cls=load_component("sampler_cls", config.sampler_cls))
        self.executor: Executor
        """Runs each step's model work: in this process, or over tensor-parallel workers."""
        if model_runner is None and config.tensor_parallel_size > 1:
            num_layers, num_kv_heads, head_dim = kv_cache_shape(self.model.config,
                                                                config.tensor_parallel_size)
            self.executor = MultiprocExecutor(
                self.model, config.tensor_parallel_size, self.device, self.dtype,
                self.attention_backend_cls, (size.num_blocks, config.block_size, num_kv_heads, head_dim),
                num_layers, self.linear_plan, make_runner)
        else:
            self.executor = UniProcExecutor(model_runner or make_runner())
        self.model_runner = self.executor.model_runner
        """The runner in this process (rank 0's with tensor parallelism)."""
        self.processor = Processor(self.tokenizer, self.model.config.vocab_size, self.max_model_len,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.trace = Trace(
            block_size=config.block_size,
            num_blocks=size.num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_steps=config.max_trace_steps,
        )
        self.output_processor = OutputProcessor(self.tokenizer) if output_processing else None
        """Text, stop strings, logprob dicts and n > 1 gathering (the scheduler sees token ids only)."""
        self._grammar_compiler: GrammarCompiler | None = None
        """Structured output's compiler (and its cache), made at the first request that asks for one."""
        self._finished_outputs: list[RequestOutput | EngineCoreOutput] = []
        """Final outputs of requests aborted between steps, handed out by the next step()."""
        self._step_index = 0
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

    # -- requests in ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | ProcessedPrompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request | list[Request]:
        """Validate and queue a request. Anything that could never be served raises
        :class:`~minivllm.exceptions.ValidationError` (a ValueError; ``param`` names the
        field, the message the value and the limit); nothing is queued then. The checks
        are the :class:`~minivllm.processor.Processor`'s; a ``ProcessedPrompt`` (from
        ``self.processor``, e.g. on the async engine's tokenizer thread) is not
        tokenized or checked again. ``priority`` (lower runs first) needs
        ``scheduling_policy="priority"``; any other value than 0 is refused under "fcfs".

        With ``params.n > 1`` the request is fanned out into n child requests
        (``minivllm.parallel_sampling``), all checked before any is queued; their outputs
        come back from ``step()`` as one output under ``request_id``, and the n child
        ``Request`` objects are returned."""
        if not isinstance(request_id, str):
            raise ValidationTypeError(
                "request_id", f"request_id must be a string, got {type(request_id).__name__}",
                request_id)
        params = self.processor.check_params(params)
        parent = ParentRequest(request_id, params) if params.n > 1 else None
        if parent is not None and self.output_processor is None:
            raise ValidationError("n", "an engine core without output processing takes one "
                                  "request per sample: its front end fans n > 1 out", params.n)
        for rid in [request_id] + (parent.child_ids if parent else []):
            if self.has_request(rid):
                raise ValidationError("request_id", f"request_id {rid!r} is already in use", rid)
        priority = check_priority(priority, self.config.scheduling_policy)
        arrival_time = check_float("arrival_time", arrival_time, optional=True)
        prompt = self.processor.process_prompt(prompt)
        self.processor.check_request(prompt, params)
        if params.structured_outputs is not None:  # a grammar that cannot compile is refused
            self._new_grammar_state(params.structured_outputs)  # before anything is queued (cached)
        if parent is not None:
            self.output_processor.parents.add(parent)
            return [self._add_checked(cid, prompt, p, arrival_time, priority)
                    for cid, p in parent.children()]
        return self._add_checked(request_id, prompt, params, arrival_time, priority)

    def _add_checked(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     arrival_time: float | None, priority: int) -> Request:
        """Queue one request whose every field has been checked."""
        ids = prompt.prompt_token_ids
        request = Request(request_id, ids, params, self.clock() if arrival_time is None else arrival_time,
                          self.eos_token_id, prompt.prompt, priority)
        if params.structured_outputs is not None:
            request.grammar = self._new_grammar_state(params.structured_outputs)
        if self.output_processor is not None:
            self.output_processor.add_request(request_id, prompt.prompt, ids, params.stop, params.min_tokens,
                                              params.logprobs is not None, request.metrics)
        self.scheduler.add_request(request)
        self.trace.requests[request_id] = request.metrics
        return request

    def _new_grammar_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A matcher for a new request with structured output (``minivllm.structured_output``),
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

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort unfinished requests. Each one's final output (finish_reason "abort") is
        made now and handed out by the next ``step()``; the id is free for reuse at once.
        Unknown ids raise KeyError and abort nothing. Aborting a request with n > 1
        aborts all its children still running."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        parents = self._parents
        ids = [c for c in parents.expand(ids) if c in self.scheduler.requests or c not in parents.parent_of]
        unknown = [i for i in ids if i not in self.scheduler.requests]
        if unknown:
            raise KeyError(f"no unfinished request with id(s) {unknown}")
        aborted = [self.scheduler.requests[i] for i in ids]
        self._finish_between_steps(aborted, RequestStatus.FINISHED_ABORTED)
        outputs = [EngineCoreOutput(r.request_id, [], "abort", num_cached_tokens=r.metrics.num_cached_tokens)
                   for r in aborted]
        if self.output_processor is not None:  # made now: the id is free for reuse at once
            outputs = self.output_processor.process_outputs(outputs).request_outputs
        self._finished_outputs.extend(outputs)

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

    @property
    def _parents(self) -> ParentRequests:
        """The requests with n > 1 (the output processor gathers their children's outputs)."""
        return self.output_processor.parents if self.output_processor is not None else ParentRequests()

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is in use: an unfinished request (a child among them), or
        a request with n > 1 whose last output has not been handed out yet."""
        return request_id in self.scheduler.requests or request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._finished_outputs)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that progressed
        (with ``output_processing=False``, each one's new token ids instead).

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

    def _step(self) -> list[RequestOutput] | list[EngineCoreOutput]:
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending; this is a bug")
            return []
        result = self._execute(scheduler_output, start)
        accepted = self.drafter.count_accepted(scheduler_output, result.sampled) if self.drafter else {}
        before = {s.request.request_id: (s.request.num_output_tokens, len(s.request.prompt_logprobs or ()))
                  for s in scheduler_output.scheduled}
        updated = self.scheduler.update_from_output(scheduler_output, result.sampled)
        self._attach_logprobs(scheduler_output, result)
        outputs = [self._core_output(r, *before[r.request_id]) for r in updated]
        if self.output_processor is not None:
            processed = self.output_processor.process_outputs(outputs)
            self._apply_finishes(processed.finishes, updated)
            outputs = processed.request_outputs
        finished, got_token = self._record_tokens(updated)
        self.executor.remove_requests(finished)
        self._record(scheduler_output, start, self.clock(), result.model_time, finished, accepted,
                     getattr(result, "parallel", None))
        self.stats.record_step(scheduler_output.num_scheduled_tokens, len(scheduler_output.preempted),
                               [m for m, _ in got_token], [n for _, n in got_token])
        if self.drafter is not None:
            self.drafter.observe_step(sum(n for _, n in got_token), result.model_time,
                                      not any(s.is_prefill for s in scheduler_output.scheduled))
            self.drafter.propose(updated, len(self.scheduler.running))
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self.clock(), self.stats, self.scheduler_stats())
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput, start: float) -> ModelRunnerOutput:
        """The forward pass and sampling; if they fail, the step is rolled back."""
        first_time = [s.request for s in scheduler_output.scheduled
                      if s.request.metrics.first_scheduled_time is None]
        for request in first_time:
            request.metrics.first_scheduled_time = start
        try:
            return self.executor.execute_model(scheduler_output)
        except BaseException:  # an error, or Ctrl-C in a notebook: leave nothing half-done
            self.scheduler.rollback(scheduler_output)
            for request in first_time:  # all were admitted this step, and are waiting again
                request.metrics.first_scheduled_time = None
            raise

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

    def _apply_finishes(self, finishes: list[FrontEndFinish], updated: list[Request]) -> None:
        """The requests the output processor finished this step (a stop string, text it
        could not make), finished here too before anything is counted: tokens after a
        stop string (accepted drafts) are dropped, so the request is exactly what one
        token per step would have given."""
        by_id = {r.request_id: r for r in updated}
        for f in finishes:
            request = by_id[f.request_id]
            num_dropped = request.num_output_tokens - f.num_output_tokens
            if num_dropped > 0:
                del request.output_token_ids[-num_dropped:]
                del request.all_token_ids[-num_dropped:]
            request.stop_reason, request.error = f.stop_reason, f.error
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED if f.finish_reason == "stop"
                                          else RequestStatus.FINISHED_ERROR)

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

    def _record(self, scheduler_output: SchedulerOutput, start: float, end: float, model_time: float,
                finished: list[str], accepted: dict[str, int], parallel: StepTiming | None = None) -> None:
        kv = self.kv_cache_manager
        tables = {r.request_id: kv.get_block_ids(r.request_id) for r in self.scheduler.running}
        refs: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = b.ref_cnt
        self.trace.record(
            StepRecord(
                step=self._step_index,
                start=start,
                end=end,
                model_time=model_time,
                scheduled=[
                    ScheduledChunk(s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.is_prefill,
                                   len(s.spec_token_ids), accepted.get(s.request.request_id, 0))
                    for s in scheduler_output.scheduled
                ],
                num_free_blocks=kv.block_pool.get_num_free_blocks(),
                num_blocks=kv.num_blocks,
                block_tables=tables,
                block_ref_counts=refs,
                preempted=list(scheduler_output.preempted),
                prefix_cache_hits=dict(scheduler_output.prefix_cache_hits),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                finished=finished,
                parallel=parallel,
            )
        )
        self._step_index += 1

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- metrics ------------------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler and KV cache as they are now (the gauges of :meth:`get_metrics`)."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if getattr(self, "executor", None) is not None:  # None: __init__ failed before it
            self.executor.shutdown()

    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms named like vLLM's (``minivllm:`` prefix)."""
        return self.stats.get_metrics(self.scheduler_stats())


def eos_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """The token that ends a request: the model's generation config says, else the tokenizer."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos
