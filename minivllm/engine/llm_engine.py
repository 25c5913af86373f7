"""LLMEngine: the engine core with its front end in the same process.

:class:`~minivllm.engine.core.EngineCore` runs the steps and deals in token ids. The
engine adds what a user of ``LLM`` (or the thread server) needs around it, as vLLM's
``LLMEngine`` does around its core:

    add_request  ->  Processor: tokenize, check everything, fan n > 1 out  ->  the core
    step         ->  the core's step  ->  OutputProcessor: text, stop strings, logprob
                     dicts, n > 1 gathered  ->  RequestOutputs

Streaming is just calling ``step()`` and reading each output's ``new_text``
(``LLM.stream`` does exactly that). The output processor is the same class the API
server uses in front of an engine core in another process (``minivllm.engine.core_client``):
the text is the same either way. Here it runs inside the step, so a stop string
finishes its request before the step is counted, exactly as if one token came per step.

In vLLM: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.core import EngineCore
from minivllm.engine.output_processor import EngineCoreOutput, FrontEndFinish, OutputProcessor
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.engine.processor import ProcessedPrompt, Processor, check_priority
from minivllm.exceptions import ValidationError, ValidationTypeError, check_float
from minivllm.outputs import RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner


class LLMEngine(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        clock: Callable[[], float] = time.perf_counter,
        model_runner: ModelRunner | None = None,
    ) -> None:
        """The core (see :class:`~minivllm.engine.core.EngineCore` for the arguments),
        then its front end: the processor that checks requests coming in and the output
        processor that makes what goes out."""
        super().__init__(config, model, tokenizer, clock, model_runner)
        self.processor = Processor(self.tokenizer, self.model.config.vocab_size, self.max_model_len,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.output_processor = OutputProcessor(self.tokenizer)
        """Text, stop strings, logprob dicts and n > 1 gathering (the core sees token ids only)."""

    def add_request(  # type: ignore[override]  # the core's takes checked requests only
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
        are the :class:`~minivllm.engine.processor.Processor`'s; a ``ProcessedPrompt`` (from
        ``self.processor``, e.g. on the async engine's tokenizer thread) is not
        tokenized or checked again. ``priority`` (lower runs first) needs
        ``scheduling_policy="priority"``; any other value than 0 is refused under "fcfs".

        With ``params.n > 1`` the request is fanned out into n child requests
        (``minivllm.engine.parallel_sampling``), all checked before any is queued; their outputs
        come back from ``step()`` as one output under ``request_id``, and the n child
        ``Request`` objects are returned."""
        if not isinstance(request_id, str):
            raise ValidationTypeError(
                "request_id", f"request_id must be a string, got {type(request_id).__name__}",
                request_id)
        params = self.processor.check_params(params)
        parent = ParentRequest(request_id, params) if params.n > 1 else None
        for rid in [request_id] + (parent.child_ids if parent else []):
            if self.has_request(rid):
                raise ValidationError("request_id", f"request_id {rid!r} is already in use", rid)
        priority = check_priority(priority, self.config.scheduling_policy)
        arrival_time = check_float("arrival_time", arrival_time, optional=True)
        prompt = self.processor.process_prompt(prompt)
        self.processor.check_request(prompt, params)
        children = parent.children() if parent is not None else [(request_id, params)]
        requests = []
        for child_id, child_params in children:  # a grammar that cannot compile fails the first
            request = super().add_request(child_id, prompt, child_params, arrival_time, priority)
            self.output_processor.add_request(
                child_id, prompt.prompt, prompt.prompt_token_ids, params.stop, params.min_tokens,
                params.logprobs is not None, request.metrics)
            requests.append(request)
        if parent is not None:
            self.output_processor.parents.add(parent)
            return requests
        return requests[0]

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort unfinished requests. Each one's final output (finish_reason "abort") is
        made now and handed out by the next ``step()``; the id is free for reuse at once.
        Unknown ids raise KeyError and abort nothing. Aborting a request with n > 1
        aborts all its children still running."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        parents = self.output_processor.parents
        ids = [c for c in parents.expand(ids) if c in self.scheduler.requests or c not in parents.parent_of]
        self.abort_requests(ids)  # their outputs are made now: each id is free for reuse at once

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is in use: an unfinished request (a child among them), or
        a request with n > 1 whose last output has not been handed out yet."""
        return request_id in self.scheduler.requests or request_id in self.output_processor.parents

    def step(self) -> list[RequestOutput]:  # type: ignore[override]
        """The core's step, its outputs made into ``RequestOutput`` objects (see :meth:`EngineCore.step`)."""
        return super().step()

    def _process_outputs(self, outputs: list[EngineCoreOutput], updated: list[Request]) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(outputs)
        self._apply_finishes(processed.finishes, updated)
        return processed.request_outputs

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
