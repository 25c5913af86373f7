"""LLM: the offline entry point, shaped like ``vllm.LLM`` (notebook 00).

``LLM.generate`` queues every prompt at once and steps the engine until all are done:
continuous batching does the rest. ``LLM.stream`` yields text deltas of one request as
the engine produces them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.engine import EngineConfig, LLMEngine
from minivllm.metrics import Metric
from minivllm.model_loader import DEFAULT_MODEL
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

Prompt = str | dict
Message = dict[str, str]


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
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        dtype: str = "float32",
        device: str = "auto",
        seed: int = 0,
        max_trace_steps: int | None = None,
        log_stats_interval: float | None = 5.0,
    ) -> None:
        """``model`` is an embedded model name, a local HF folder, or a loaded model
        (then pass its ``tokenizer``, or None to work with token ids only)."""
        config = EngineConfig(
            model=model if isinstance(model, str) else type(model).__name__,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            linear_backend=linear_backend,
            dtype=dtype,
            device=device,
            seed=seed,
            max_trace_steps=max_trace_steps,
            log_stats_interval=log_stats_interval,
        )
        loaded = None if isinstance(model, str) else model
        self.llm_engine = LLMEngine(config, loaded, tokenizer)
        self._counter = itertools.count()

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
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params)} sampling params; "
                    "pass one SamplingParams or one per prompt"
                )
        ids = self._add_all(prompts, params)
        return self._run(ids, use_tqdm)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Queue all or nothing: if one prompt is invalid, the ones before it are withdrawn."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            if ids:
                engine.abort_request(ids)
                engine.step()  # hand out (and discard) the abort outputs
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        in_toks = out_toks = 0
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            # Like vLLM's bar: tokens of finished requests over wall time.
                            in_toks += len(out.prompt_token_ids)
                            out_toks += len(out.outputs[0].token_ids)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(
                                f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                f"output: {out_toks / elapsed:.2f} toks/s",
                                refresh=False,
                            )
                            bar.update(1)
        except BaseException:
            pending = [i for i in ids if i not in done and i in engine.scheduler.requests]
            if pending:  # e.g. KeyboardInterrupt in a notebook: leave nothing hanging
                engine.abort_request(pending)
                engine.step()
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
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self._chat_ids(c, add_generation_prompt)} for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_ids(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        ids = self.get_tokenizer().apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def stream(
        self, prompt: Prompt | list[Message], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the text of one request piece by piece as the engine produces it.

        A list of chat messages is templated first. Other requests already queued on the
        engine keep being served in the same steps.
        """
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": self._chat_ids(prompt)}
        engine = self.llm_engine
        rid = str(next(self._counter))
        engine.add_request(rid, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == rid:
                        if out.new_text:
                            yield out.new_text
                        finished = out.finished
        finally:
            if not finished and rid in engine.scheduler.requests:
                engine.abort_request(rid)  # the caller stopped iterating early

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()
