"""LLMEngine: the loop that ties scheduler, block manager and model runner together.

One call to :meth:`LLMEngine.step` is one iteration of continuous batching:

    schedule  ->  run the model on the packed batch  ->  append tokens, check stops
              ->  detokenize  ->  record the step in the trace  ->  RequestOutputs

Requests may be added or aborted between any two steps; that is what makes the batching
*continuous*. Streaming is just calling ``step()`` and reading each output's
``new_text`` (``LLM.stream`` does exactly that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.attention import BACKENDS, resolve_backend
from minivllm.core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.exceptions import (
    ValidationError,
    ValidationTypeError,
    check_bool,
    check_float,
    check_int,
)
from minivllm.linear import LINEAR_BACKENDS, choose_linear_plan, resolve_linear_backend
from minivllm.metrics import EngineStats, LoggingStatLogger, Metric, SchedulerStats
from minivllm.model_loader import DEFAULT_MODEL, load_model
from minivllm.model_runner import ModelRunner, kv_cache_bytes_per_token
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from minivllm.trace import ScheduledChunk, StepRecord, Trace

logger = logging.getLogger("minivllm")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: about 23k tokens of SmolLM2-135M in float32


@dataclass
class EngineConfig:
    """Every knob of the engine, with vLLM's names."""

    model: str = DEFAULT_MODEL
    block_size: int = 16
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides kv_cache_memory."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache (default 1 GiB, or what max_num_seqs full-length requests need if less)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    """"auto": on a CPU, oneDNN or nn.Linear per row count, whichever measured faster here
    (minivllm.linear; measured once, then cached); "onednn"; "torch": nn.Linear as is."""
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    max_trace_steps: int | None = None
    """Keep only this many most recent steps in the trace (None: all)."""
    log_stats_interval: float | None = 5.0
    """Seconds between throughput/KV-usage log lines on the ``minivllm`` logger (None or 0: off)."""

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every knob's type and range; raise ValidationError naming the first bad one.
        (What depends on the model, such as max_model_len against the KV cache, is
        checked when the engine is built.)"""
        if not isinstance(self.model, str) or not self.model:
            raise ValidationTypeError("model", f"model must be a non-empty string, got {self.model!r}",
                                      self.model)
        self.block_size = check_int("block_size", self.block_size, minimum=1)
        self.num_kv_blocks = check_int("num_kv_blocks", self.num_kv_blocks, minimum=1, optional=True)
        self.kv_cache_memory = check_int("kv_cache_memory", self.kv_cache_memory, minimum=1,
                                         optional=True)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", self.max_num_batched_tokens,
                                                minimum=1)
        # Two tokens at least: a prompt token and the one generated from it.
        self.max_model_len = check_int("max_model_len", self.max_model_len, minimum=2, optional=True)
        self.enable_chunked_prefill = check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        self.enable_prefix_caching = check_bool("enable_prefix_caching", self.enable_prefix_caching)
        for param, value, allowed in (("attention_backend", self.attention_backend, BACKENDS),
                                      ("linear_backend", self.linear_backend, LINEAR_BACKENDS),
                                      ("dtype", self.dtype, tuple(DTYPES))):
            if value not in allowed:
                raise ValidationError(param, f"{param} must be one of {allowed}, got {value!r}", value)
        if not isinstance(self.device, str):
            raise ValidationTypeError("device", f"device must be a string such as 'cpu', 'cuda' or "
                                      f"'auto', got {self.device!r}", self.device)
        self.seed = check_int("seed", self.seed, minimum=SEED_MIN, maximum=SEED_MAX)
        self.max_trace_steps = check_int("max_trace_steps", self.max_trace_steps, minimum=1,
                                         optional=True)
        self.log_stats_interval = check_float("log_stats_interval", self.log_stats_interval,
                                              minimum=0, optional=True)


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA when there is one, else the CPU; anything else must work here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
        torch.empty(0, device=device)  # a CPU-only torch fails here for "cuda"
    except (RuntimeError, AssertionError) as e:
        raise ValidationError(
            "device", f"device {name!r} cannot be used on this machine ({e}); "
                      f"use 'auto' or 'cpu' (CUDA available: {torch.cuda.is_available()})", name
        ) from None
    return device


@dataclass
class _OutputState:
    """Per-request detokenization state kept by the engine (not by the scheduler)."""

    detokenizer: IncrementalDetokenizer
    sent: int = 0
    """Characters of text already handed out in earlier outputs."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config.verify()  # again: fields may have been changed since it was made
        self.config = config
        self.clock = clock
        """Source of every timestamp; the simulated runner swaps in a virtual clock."""
        dtype = DTYPES[config.dtype]
        device = resolve_device(config.device)
        try:
            backend = resolve_backend(config.attention_backend, device)
        except (ValueError, RuntimeError) as e:
            raise ValidationError("attention_backend", str(e), config.attention_backend) from None
        try:
            linear = resolve_linear_backend(config.linear_backend, device, dtype)
        except ValueError as e:
            raise ValidationError("linear_backend", str(e), config.linear_backend) from None
        if model is None:
            model, tokenizer = load_model(config.model, dtype, device)
        else:
            model = model.to(device=device, dtype=dtype).eval()
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.attention_backend = backend
        self.linear_plan = choose_linear_plan(linear, model)
        self.linear_backend = self.linear_plan.name
        eos = model.generation_config.eos_token_id if model.generation_config else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos

        model_max = getattr(model.config, "max_position_embeddings", None) or 2048
        bytes_per_token = kv_cache_bytes_per_token(model, dtype)
        block_bytes = bytes_per_token * config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            num_blocks = budget // block_bytes
            if config.kv_cache_memory is None:  # don't reserve more than the engine can use
                max_len = config.max_model_len or model_max
                num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_len, config.block_size))
        if num_blocks < 1:
            raise ValidationError(
                "kv_cache_memory",
                f"the KV cache holds no block: one block of {config.block_size} tokens needs "
                f"{block_bytes} bytes, kv_cache_memory is {config.kv_cache_memory}",
                config.kv_cache_memory,
            )
        capacity = num_blocks * config.block_size
        self.max_model_len = config.max_model_len or min(model_max, capacity)
        if self.max_model_len > model_max:
            raise ValidationError(
                "max_model_len",
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max}",
                self.max_model_len,
            )
        if self.max_model_len > capacity:
            # As vLLM does: a request may grow to max_model_len tokens (a chat request
            # without max_tokens does), so the cache must hold one that long, or such a
            # request could never run. Better refused now than every such request later.
            raise ValidationError(
                "max_model_len",
                f"max_model_len {self.max_model_len} is more than the KV cache holds: "
                f"{num_blocks} blocks of {config.block_size} tokens = {capacity} tokens. "
                f"Give the cache more blocks (num_kv_blocks, kv_cache_memory) or lower max_model_len",
                self.max_model_len,
            )

        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.model_runner = ModelRunner(
            model, self.kv_cache_manager, backend, device, dtype, config.seed, linear_plan=self.linear_plan
        )
        self.trace = Trace(
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_steps=config.max_trace_steps,
        )
        self._states: dict[str, _OutputState] = {}
        self._finished_outputs: list[RequestOutput] = []
        """Final outputs of requests aborted between steps, handed out by the next step()."""
        self._step_index = 0
        self.stats = EngineStats()
        """Engine-wide counters and histograms behind :meth:`get_metrics`."""
        self._stat_logger = (
            LoggingStatLogger(config.log_stats_interval, clock()) if config.log_stats_interval else None
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens). Maximum concurrency for "
            "%d tokens per request: %.2fx. Attention backend: %s, linear backend: %s, on %s.",
            num_blocks, config.block_size, num_blocks * block_bytes / 2**20, capacity,
            self.max_model_len, capacity / self.max_model_len, backend, self.linear_backend, device,
        )

    # -- requests in ------------------------------------------------------------------
    def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt_token_ids", "prompt"})
            if unknown or "prompt_token_ids" not in prompt:
                raise ValidationError(
                    "prompt", "a dict prompt takes the key 'prompt_token_ids' (a list of token ids) "
                              f"and optionally 'prompt' (its text); got the keys {sorted(prompt)}",
                    sorted(prompt))
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValidationTypeError(
                    "prompt", f"'prompt' must be a string, got {type(text).__name__}", text)
            return text, _check_token_ids(prompt["prompt_token_ids"], self.model.config.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(
                    "prompt", "this engine has no tokenizer: pass {'prompt_token_ids': [...]}", prompt)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        raise ValidationTypeError(
            "prompt", f"prompt must be a str or a {{'prompt_token_ids': [...]}} dict, "
                      f"got {type(prompt).__name__}", prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request. Anything that could never be served raises
        :class:`~minivllm.exceptions.ValidationError` (a ValueError; ``param`` names the
        field, the message the value and the limit); nothing is queued then."""
        if not isinstance(request_id, str):
            raise ValidationTypeError(
                "request_id", f"request_id must be a string, got {type(request_id).__name__}",
                request_id)
        if request_id in self.scheduler.requests:
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use",
                                  request_id)
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValidationTypeError(
                "sampling_params", f"sampling params must be a SamplingParams, got "
                                   f"{type(params).__name__}", params)
        else:
            params.verify()
        arrival_time = check_float("arrival_time", arrival_time, optional=True)
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValidationError("prompt", "the prompt is empty: it needs at least one token", ids)
        if len(ids) >= self.max_model_len:
            raise ValidationError(
                "prompt",
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)", len(ids))
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise ValidationError(
                "prompt",
                f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens}, and chunked prefill is off", len(ids))
        vocab = self.model.config.vocab_size
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise ValidationError(
                "stop_token_ids", f"stop_token_ids must be in [0, {vocab}), got {bad_stops}", bad_stops)
        # max_model_len <= the cache's capacity (checked in __init__), so any request that
        # passes the checks above fits the cache on its own, however long it grows.
        now = self.clock()
        request = Request(request_id, ids, params, arrival_time if arrival_time is not None else now,
                          self.eos_token_id, text)
        self._states[request_id] = _OutputState(IncrementalDetokenizer(self.tokenizer, ids))
        self.scheduler.add_request(request)
        self.trace.requests[request_id] = request.metrics
        return request

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort unfinished requests. Each one's final output (finish_reason "abort") is
        made now and handed out by the next ``step()``; the id is free for reuse at once.
        Unknown ids raise KeyError and abort nothing."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        unknown = [i for i in ids if i not in self.scheduler.requests]
        if unknown:
            raise KeyError(f"no unfinished request with id(s) {unknown}")
        now = self.clock()
        for i in ids:
            request = self.scheduler.requests[i]
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
            request.metrics.finished_time = now
            self.stats.record_finished(request.metrics, "abort")
            self._finished_outputs.append(self._make_output(request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._finished_outputs)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that progressed.

        Isolation: a failure that belongs to one request (its sampling, its
        detokenization) finishes that request alone, with finish_reason "error" and the
        message in ``outputs[0].error``. A failure of the forward pass, which the whole
        batch shares, is rolled back (``Scheduler.rollback``) and re-raised: the engine is
        then exactly as before the step, and stepping again retries it.
        """
        outputs, self._finished_outputs = self._finished_outputs, []
        start = self.clock()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished_requests():
                self._finished_outputs = outputs
                raise RuntimeError("scheduler made no progress with requests pending; this is a bug")
            return outputs
        first_time = [s.request for s in sched.scheduled if s.request.metrics.first_scheduled_time is None]
        for request in first_time:
            request.metrics.first_scheduled_time = start
        try:
            result = self.model_runner.execute_model(sched)
        except BaseException:  # an error, or Ctrl-C in a notebook: leave nothing half-done
            self.scheduler.rollback(sched)
            for request in first_time:  # all were admitted this step, and are waiting again
                request.metrics.first_scheduled_time = None
            self._finished_outputs = outputs + self._finished_outputs
            raise
        updated = self.scheduler.update_from_output(sched, result.sampled)
        now = self.clock()
        finished = []
        got_token = []
        for request in updated:
            m = request.metrics
            if request.status is not RequestStatus.FINISHED_ERROR:  # it got a token
                got_token.append(m)
                m.token_times.append(now)
                if m.first_token_time is None:
                    m.first_token_time = now
                try:
                    self._process_text(request)
                except Exception as e:  # this request's text alone: finish it, not the step
                    self._fail(request, f"detokenization failed: {type(e).__name__}: {e}")
            if request.is_finished:
                m.finished_time = now
                finished.append(request.request_id)
                self.stats.record_finished(m, request.finish_reason)
            outputs.append(self._make_output(request))
        self._record(sched, start, self.clock(), result.model_time, finished)
        self.stats.record_step(sched.num_scheduled_tokens, len(sched.preempted), got_token)
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self.clock(), self.stats, self.scheduler_stats())
        return outputs

    def _fail(self, request: Request, message: str) -> None:
        """Finish one request with finish_reason "error" (it may have finished already
        this step, e.g. on its last token; then only the reason changes)."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.error = message
        if request.is_finished:
            request.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)

    def _process_text(self, request: Request) -> None:
        """Detokenize the new token; finish the request if a stop string appeared.

        Stop strings are checked on every token, the last one allowed included: a stop
        string completed by the token that also reached max_tokens ends the request with
        "stop", not "length" (as in vLLM, the detokenizer's stop beats the length cap).
        """
        state = self._states[request.request_id]
        delta = state.detokenizer.add_token(request.output_token_ids[-1])
        params = request.sampling_params
        if not params.stop or request.num_output_tokens < params.min_tokens:
            return
        if request.is_finished and request.status is not RequestStatus.FINISHED_LENGTH:
            return  # EOS or a stop token ended it: nothing to decide
        text = state.detokenizer.text
        # Only the new text (plus an overlap the length of a stop string) can hold a new match.
        begin = max(0, len(text) - len(delta) - max(map(len, params.stop)) + 1)
        hits = [(text.find(s, begin), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            state.detokenizer.text = text[:index]
            request.stop_reason = stop
            if request.is_finished:  # by length, this very token: its blocks are already free
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, request: Request) -> RequestOutput:
        state = self._states[request.request_id]
        text = state.detokenizer.text
        visible = len(text)
        if not request.is_finished and request.sampling_params.stop:
            # Hold back what could be the start of a stop string until it is decided.
            visible = max(state.sent, len(text) - max(map(len, request.sampling_params.stop)) + 1)
        new_text = text[state.sent : visible]
        state.sent = max(state.sent, visible)
        if request.is_finished:
            del self._states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text[:visible],
                    token_ids=list(request.output_token_ids),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    error=request.error,
                )
            ],
            finished=request.is_finished,
            metrics=request.metrics,
            num_cached_tokens=request.metrics.num_cached_tokens,
            new_text=new_text,
        )

    def _record(self, sched: SchedulerOutput, start: float, end: float, model_time: float,
                finished: list[str]) -> None:
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
                    ScheduledChunk(s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.is_prefill)
                    for s in sched.scheduled
                ],
                num_free_blocks=kv.block_pool.get_num_free_blocks(),
                num_blocks=kv.num_blocks,
                block_tables=tables,
                block_ref_counts=refs,
                preempted=list(sched.preempted),
                prefix_cache_hits=dict(sched.prefix_cache_hits),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                finished=finished,
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

    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms named like vLLM's (``minivllm:`` prefix)."""
        return self.stats.get_metrics(self.scheduler_stats())


def _check_token_ids(ids: object, vocab_size: int) -> list[int]:
    """Prompt token ids: a list (or tuple) of exact integers in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValidationTypeError(
            "prompt", f"prompt_token_ids must be a list of integers, got {type(ids).__name__}"
                      + ("; pass ids.tolist()" if hasattr(ids, "tolist") else ""), ids)
    ids = list(ids)
    if not all(type(i) is int for i in ids):  # the fast path first: plain ints
        ids = [check_int("prompt", i) for i in ids]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValidationError(
            "prompt", f"prompt token ids must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}",
            [min(ids), max(ids)])
    return ids
