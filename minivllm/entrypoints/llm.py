"""LLM: the offline entry point, shaped like ``vllm.LLM`` (notebook 00).

``LLM.generate`` queues every prompt at once and steps the engine until all are done:
continuous batching does the rest. ``LLM.stream`` yields text deltas of one request as
the engine produces them.

Every step of the engine returns outputs for *all* requests that progressed, whoever is
waiting for them. So the outputs go through per-request buffers: each caller (a
``generate`` call, each open ``stream``) steps the engine until its own buffer has
something, and leaves the others' outputs in theirs. Two streams pulled in turn, or a
``generate`` while a stream is open, all see every one of their outputs. (An ``LLM`` is
not thread-safe: use it from one thread, or serve it with ``minivllm.entrypoints.openai.api_server``.)
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.processor import ProcessedPrompt
from minivllm.exceptions import ValidationError, ValidationTypeError, check_bool
from minivllm.metrics import Metric
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_loader import DEFAULT_MODEL

Prompt = str | dict | ProcessedPrompt
Message = dict[str, object]


class RequestFailedError(RuntimeError):
    """A streamed request finished with finish_reason "error" (the message says why)."""


class LLM:
    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        attention_backend: str | type = "auto",
        linear_backend: str = "auto",
        dtype: str = "float32",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        max_trace_steps: int | None = None,
        log_stats_interval: float | None = 5.0,
        scheduler_cls: str | type = "minivllm.core.scheduler:Scheduler",
        kv_cache_manager_cls: str | type = "minivllm.core.kv_cache_manager:KVCacheManager",
        block_pool_cls: str | type = "minivllm.core.block_pool:BlockPool",
        sampler_cls: str | type = "minivllm.sample.sampler:Sampler",
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str = "mp",
        kv_transfer_config: dict | None = None,
        speculative_config: dict | None = None,
        compilation_config: dict | int | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool = False,
    ) -> None:
        """``model`` is an embedded model name, a local HF folder, or a loaded model
        (then pass its ``tokenizer``, or None to work with token ids only). Every option
        is checked here (``EngineConfig``): a bad one raises ValidationError naming it."""
        if not isinstance(model, (str, PreTrainedModel)):
            raise ValidationTypeError(
                "model", f"model must be a model name, a folder or a transformers model, got "
                         f"{type(model).__name__}", model)
        # Every keyword above is the EngineConfig field of the same name, passed on as is.
        config = EngineConfig(
            model=model if isinstance(model, str) else type(model).__name__,
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
            attention_backend=attention_backend, linear_backend=linear_backend, dtype=dtype,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype, device=device, seed=seed,
            max_trace_steps=max_trace_steps,
            log_stats_interval=log_stats_interval, scheduler_cls=scheduler_cls,
            kv_cache_manager_cls=kv_cache_manager_cls, block_pool_cls=block_pool_cls,
            sampler_cls=sampler_cls, tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            kv_transfer_config=kv_transfer_config, speculative_config=speculative_config,
            compilation_config=compilation_config, enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
        )
        loaded = None if isinstance(model, str) else model
        self.llm_engine = LLMEngine(config, loaded, tokenizer)
        self._counter = itertools.count()
        self._outputs: dict[str, deque[RequestOutput]] = {}
        """Outputs not yet read, per request someone here is waiting for."""

    def close(self) -> None:
        """Release what the engine holds outside this process: with
        ``tensor_parallel_size`` > 1, its worker processes (they also end when the LLM is
        garbage-collected or this process exits). The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_metrics(self) -> list[Metric]:
        """Engine metrics, as vLLM's ``LLM.get_metrics()``: a list of Counter, Gauge and
        Histogram records (see ``minivllm.metrics``)."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.llm_engine.tokenizer

    @property
    def trace(self):
        """The engine's step trace (see ``minivllm.trace``), what ``minivllm.viz`` draws."""
        return self.llm_engine.trace

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order, one per prompt
        (with ``n > 1`` its ``outputs`` hold the n completions, by ``index``).

        ``priority``: one integer per prompt (lower runs first), as vLLM takes it; only
        with ``scheduling_policy="priority"`` (non-zero values are refused under "fcfs")."""
        check_bool("use_tqdm", use_tqdm)
        if isinstance(prompts, (str, dict, ProcessedPrompt)):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise ValidationTypeError(
                "prompt", f"prompts must be a str, a dict or a list of them, got "
                          f"{type(prompts).__name__}", prompts)
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValidationError(
                    "sampling_params",
                    f"got {len(prompts)} prompts but {len(params)} sampling_params; "
                    "pass one SamplingParams or one per prompt", len(params))
        else:
            raise ValidationTypeError(
                "sampling_params", f"sampling_params must be a SamplingParams or a list of them, "
                                   f"got {type(sampling_params).__name__}", sampling_params)
        if priority is None:
            priorities = [0] * len(prompts)
        elif isinstance(priority, Sequence) and not isinstance(priority, str):
            priorities = list(priority)
            if len(priorities) != len(prompts):
                raise ValidationError(
                    "priority", f"got {len(prompts)} prompts but {len(priorities)} priorities; "
                                "pass one priority per prompt", len(priorities))
        else:
            raise ValidationTypeError(
                "priority", f"priority must be a list of integers, one per prompt, got "
                            f"{type(priority).__name__}", priority)
        ids = self._add_all(prompts, params, priorities)
        return self._run(ids, use_tqdm)

    def _add(self, prompt: Prompt, params: SamplingParams | None, priority: int = 0) -> str:
        """Queue one request, with a buffer for its outputs."""
        rid = str(next(self._counter))
        self._outputs[rid] = deque()
        try:
            self.llm_engine.add_request(rid, prompt, params, priority=priority)
        except BaseException:
            del self._outputs[rid]
            raise
        return rid

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams],
                 priorities: list[int]) -> list[str]:
        """Queue all or nothing: if one prompt is invalid, the ones before it are withdrawn."""
        ids: list[str] = []
        try:
            for prompt, p, priority in zip(prompts, params, priorities):
                ids.append(self._add(prompt, p, priority))
        except Exception:
            if ids:
                self._abort(ids)
                self._step()  # hand out (and drop) the abort outputs
            raise
        return ids

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self._outputs.pop(rid, None)
        live = [rid for rid in ids if self.llm_engine.has_request(rid)]
        if live:
            self.llm_engine.abort_request(live)

    def _step(self) -> None:
        """One engine step; each output goes to the buffer of whoever waits for it."""
        for out in self.llm_engine.step():
            buffer = self._outputs.get(out.request_id)
            if buffer is not None:  # None: nobody here is waiting (e.g. added to the engine directly)
                buffer.append(out)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        in_toks = out_toks = 0
        try:
            while len(done) < len(ids):
                self._step()
                for rid in ids:
                    buffer = self._outputs.get(rid)
                    if not buffer:
                        continue
                    out = buffer[-1]
                    buffer.clear()  # generate() keeps only the final output
                    if not out.finished:
                        continue
                    done[rid] = out
                    del self._outputs[rid]
                    if bar is not None:
                        # Like vLLM's bar: tokens of finished requests over wall time.
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                            f"output: {out_toks / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
            # With async scheduling the step scheduled behind the last stop is still in
            # flight (its token is thrown away): process it now, so that this call's trace
            # ends with it. Not while other requests run: it belongs to their steps then.
            engine = self.llm_engine
            while engine.has_steps_in_flight() and not engine.scheduler.has_unfinished_requests():
                self._step()
        except BaseException:
            # e.g. KeyboardInterrupt in a notebook: leave nothing hanging. (A failed step
            # has been rolled back by the engine; the abort outputs go out with the next.)
            self._abort([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them.

        A message is ``{"role": "system" | "user" | "assistant", "content": ...}``;
        content is a string or a list of text parts ``{"type": "text", "text": ...}``
        (see ``minivllm.entrypoints.chat_utils``). A malformed message raises ValidationError."""
        if isinstance(messages, Sequence) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, Sequence) and messages and all(isinstance(c, list) for c in messages):
            conversations = list(messages)
        else:  # empty, or a mixture: let the checks say what is wrong with it
            conversations = [messages]
        processor = self.llm_engine.processor
        prompts = [processor.process_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_ids(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.llm_engine.processor.process_chat(conversation, add_generation_prompt).prompt_token_ids

    def stream(
        self, prompt: Prompt | list[Message], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the text of one request piece by piece as the engine produces it.

        A list of chat messages is templated first. Other requests already queued on the
        engine keep being served in the same steps, and other streams (or a ``generate``
        call) may be consumed in between: each keeps its own outputs. If the request
        fails (finish_reason "error"), :class:`RequestFailedError` is raised after the
        text it produced. Nothing is queued until the first piece is asked for. One
        text, so ``n`` must be 1 (``generate`` or the server give n completions).
        """
        if sampling_params is not None and sampling_params.n != 1:
            raise ValidationError("n", f"LLM.stream yields the text of one completion, so n must "
                                       f"be 1, got {sampling_params.n}; use generate() for n > 1",
                                  sampling_params.n)
        if isinstance(prompt, list):
            prompt = self.llm_engine.processor.process_chat(prompt)
        rid = self._add(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                buffer = self._outputs[rid]
                if not buffer:
                    self._step()
                    continue
                out = buffer.popleft()
                if out.new_text:
                    yield out.new_text
                finished = out.finished
            if out.outputs[0].finish_reason == "error":
                raise RequestFailedError(f"request {rid} failed: {out.outputs[0].error}")
        finally:
            if not finished:  # the caller stopped iterating early, or a step failed
                self._abort([rid])
            self._outputs.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()
