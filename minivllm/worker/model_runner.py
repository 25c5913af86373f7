"""ModelRunner: turns a SchedulerOutput into one forward pass and one token per request.

Every scheduled token of every request is packed into a single flat batch of shape
``[1, num_tokens]`` (no padding): a 300-token prompt chunk and thirty one-token decodes
are one tensor. Alongside go the positions of those tokens, the cache slot each new key
and value is written to (``slot_mapping``), each sequence's block table, where each
sequence starts in the flat batch (``query_start_loc``) and how long it is afterwards
(``seq_lens``). The stock transformers model runs on that with our registered attention
function (``minivllm.worker.attention``), which hands each layer's queries, keys and values to
the attention backend in one call; logits are computed only at the last token of each
request that samples this step: a prompt chunk that is not the last needs none.

With speculative decoding (``minivllm.spec_decode``) a request's draft tokens follow its
last token in the same flat batch, like a short prompt chunk; logits are kept at the
last token and at every draft, and the rejection sampler turns those rows into the
accepted drafts plus one token.

The runner knows nothing of processes or ranks: an executor (``minivllm.executor.abstract``) owns
it and calls :meth:`ModelRunner.execute_model`, or, with tensor parallelism, its three
parts (:meth:`~ModelRunner.prepare_step`, :meth:`~ModelRunner.forward`,
:meth:`~ModelRunner.sample_step`) with the other ranks' forward passes around the middle
one (``minivllm.executor.multiproc_executor``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from minivllm.compilation import compile_model, forward_context, warm_up
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.kv_transfer.base import KVConnectorOutput
from minivllm.request import Request
from minivllm.sample.logprobs import PositionLogprobs, compute_logprobs
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.sampler import Sampler, SamplingError, apply_logits_processors
from minivllm.spec_decode.rejection_sampler import RejectionSampler
from minivllm.worker.attention import (
    ATTN_IMPLEMENTATION,
    AttentionBackend,
    AttentionMetadata,
    get_attn_backend,
)
from minivllm.worker.kv_cache_quant import KVCacheQuantization
from minivllm.worker.linear_plan import STOCK_PLAN, LinearPlan, planned_linear

if TYPE_CHECKING:
    from minivllm.config import CompilationConfig
    from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
    from minivllm.executor.multiproc_executor import StepTiming

logger = logging.getLogger("minivllm")


def kv_cache_shape(config, tensor_parallel_size: int = 1) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers decoder config; with tensor
    parallelism, the KV heads of one rank (each holds ``num_kv_heads / T``)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, num_kv_heads // tensor_parallel_size, head_dim


def kv_cache_bytes_per_token(model: PreTrainedModel, dtype: torch.dtype,
                             tensor_parallel_size: int = 1) -> int:
    """K and V, every layer, every KV head: what one token costs in the cache (of one
    rank, with tensor parallelism: the cache's memory is per rank, as vLLM's is per GPU)."""
    num_layers, num_kv_heads, head_dim = kv_cache_shape(model.config, tensor_parallel_size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]]
    """request_id -> its new tokens, for the requests that sampled this step: one, or
    with drafts, the accepted drafts and then the target's own token."""
    model_time: float
    """Seconds spent in the forward pass and sampler."""
    model_start: float | None = None
    """When the forward pass began (``time.perf_counter``); None from a runner that does not say."""
    parallel: StepTiming | None = None
    """With tensor parallelism: the forward pass of every rank, compute vs communication."""
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """request_id -> one entry per token in ``sampled``, for requests with ``logprobs``."""
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """request_id -> the next prompt tokens' entries, for requests with ``prompt_logprobs``
    that ran prompt positions this step (a chunk gives its own positions)."""
    errors: dict[str, str] = field(default_factory=dict)
    """request_id -> why sampling failed for that one request (it is in no other field):
    the engine finishes it alone, with finish_reason "error"."""
    kv_connector_output: KVConnectorOutput | None = None
    """With a KV connector: what its worker side reported after the step."""


def prompt_logprob_rows(scheduler_output: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(request id, index in the flat batch, prompt token it predicts, how many top tokens
    it wants) for every prompt
    position whose logits a ``prompt_logprobs`` request needs this step.

    Position ``p`` predicts token ``p + 1``; the last prompt position predicts the first
    output token (the sampler's row), so a prompt of P tokens needs positions 0..P-2. A
    chunk contributes the positions it runs; positions already scored (a preempted request
    computing its prompt again) are skipped, so each prompt token is scored once."""
    rows, offset = [], 0
    for s in scheduler_output.scheduled:
        req = s.request
        done = req.prompt_logprobs
        if done is not None:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for p in range(max(start, len(done) - 1), min(end, req.num_prompt_tokens - 1)):
                rows.append((req.request_id, offset + p - start, req.prompt_token_ids[p + 1],
                             req.sampling_params.prompt_logprobs))
        offset += s.num_new_tokens
    return rows


def placeholder_rows(scheduler_output: SchedulerOutput) -> list[tuple[int, str]]:
    """(index in the flat batch, request id) of every token this step computes that the
    engine does not know yet: with async scheduling, a decode scheduled while the step
    before it is still sampling that very token (``minivllm.core.async_scheduler``). It is
    the last known position of its request's rows, before any drafts. Empty without."""
    rows, offset = [], 0
    for s in scheduler_output.scheduled:
        num_known = s.num_new_tokens - len(s.spec_token_ids)
        if s.num_computed_tokens + num_known > s.request.num_tokens:
            rows.append((offset + num_known - 1, s.request.request_id))
        offset += s.num_new_tokens
    return rows


@dataclass
class StepInputs:
    """One step's inputs, between :meth:`ModelRunner.prepare_step` and the sampler."""
    inputs: dict
    """The model's keyword arguments: ``input_ids``, ``position_ids``, the attention backend and metadata."""
    logits_indices: list[int]
    """Where in the flat batch the sampler's logits rows are (prompt-logprob rows follow)."""
    sampling: SamplingMetadata
    start: float
    """When the step's model work began (``perf_counter``): ``model_time`` counts from here."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's transfers for this step (``SchedulerOutput.kv_connector_metadata``)."""
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    """(index in the flat batch, request id) of each token still being sampled when the
    step was prepared (:func:`placeholder_rows`)."""


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache_manager: KVCacheManager,
        attention_backend: str | type[AttentionBackend],
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        linear_plan: LinearPlan = STOCK_PLAN,
        sampler_cls: type = Sampler,
        num_kv_heads: int | None = None,
        kv_cache_quantization: KVCacheQuantization | None = None,
        kv_connector: KVConnectorBase_V1 | None = None,
        compilation: CompilationConfig | None = None,
    ) -> None:
        """``compilation``: compile the model (``minivllm.compilation``; None: eager).
        ``num_kv_heads``: the KV heads this runner's cache holds, by default all of
        the model's. With tensor parallelism ``model`` is one rank's shard, and the cache
        holds that rank's share of the heads. ``kv_cache_quantization``: an 8-bit cache's
        dtype and per-layer scales (None: the cache in ``dtype``). ``kv_connector``: its
        worker side (``minivllm.distributed.kv_transfer``) is handed the cache here, and
        each step's transfers around and inside the forward pass."""
        self.model = model
        self.device = device
        self.block_size = kv_cache_manager.block_size
        self.kv_cache_manager = kv_cache_manager
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # Swapped to the plan's libraries only for the engine's own forward passes (minivllm.worker.linear).
        self.linear_plan = linear_plan
        self.linears = linear_plan.assign(model)
        num_layers, all_kv_heads, head_dim = kv_cache_shape(model.config)
        num_kv_heads = num_kv_heads or all_kv_heads
        shape = (kv_cache_manager.num_blocks, self.block_size, num_kv_heads, head_dim)
        # Zeros rather than empty: no attention path reads a slot before it is written, but
        # a cache that starts defined keeps any such bug visible as wrong numbers, not NaN.
        quant = kv_cache_quantization
        cache_dtype = quant.dtype if quant else dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=cache_dtype, device=device),
             torch.zeros(shape, dtype=cache_dtype, device=device))
            for _ in range(num_layers)
        ]
        self.attn_backend = get_attn_backend(attention_backend, self.kv_caches, device,
                                             kv_scales=quant.scales if quant else None)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)
        self.compiled = None
        """The compiled forward pass (None: the model runs eagerly)."""
        self.compile_seconds = 0.0
        if compilation is not None:
            self.compiled = compile_model(model, compilation)
            self.compile_seconds = warm_up(self._dummy_forward)
            logger.info("Compiled the model (torch.compile, backend %s) in %.1f s: one graph for one "
                        "token, one for any number", compilation.backend, self.compile_seconds)
        self.sampler = sampler_cls(seed)
        self.rejection_sampler = RejectionSampler()
        self.last_sampled: dict[str, list[int]] = {}
        """The tokens the last step sampled (what a placeholder of the next one stands for)."""
        self.generators: dict[str, torch.Generator] = {}
        """request_id -> the private generator of a request with a seed (vLLM keeps them in
        its input batch). Made when the request first samples, dropped when it finishes
        (:meth:`remove_requests`). A preempted request keeps its generator: when it is
        recomputed and samples again, its draws continue where they stopped, so a seeded
        request gives the same tokens with or without preemption."""

    def remove_requests(self, request_ids: list[str]) -> None:
        """Forget what the runner keeps for these requests (they have finished)."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        """The request's private generator, made at first sight; None without a seed (it
        then draws from the sampler's shared one). Private generators keep a seeded
        request's output independent of whatever else shares the batch."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.request_id not in self.generators:
            self.generators[request.request_id] = torch.Generator().manual_seed(seed)
        return self.generators[request.request_id]

    def prepare_inputs(self, scheduler_output: SchedulerOutput
                       ) -> tuple[dict, list[int], list[tuple[Request, list[int]]]]:
        """Pack the scheduled tokens into flat model inputs and attention metadata.

        Also returns where logits are needed (``logits_indices``) and, in that order,
        each sampling request with its drafts: it owns ``1 + len(drafts)`` rows."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        samplers = []
        for s in scheduler_output.scheduled:
            req = s.request
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            table = self.kv_cache_manager.get_block_ids(req.request_id)
            known = req.all_token_ids[start : end - len(s.spec_token_ids)]
            input_ids.extend(known)
            # A token still being sampled (async scheduling): execute_step fills it in.
            input_ids.extend([0] * (end - len(s.spec_token_ids) - start - len(known)))
            input_ids.extend(s.spec_token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                last = len(input_ids) - 1
                logits_indices.extend(range(last - len(s.spec_token_ids), last + 1))
                samplers.append((req, s.spec_token_ids))
        width = max(len(t) for t in tables)
        block_tables = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device

        def as_tensor(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype, device=dev)

        # Once per step, for every layer: the common metadata, then what the backend adds.
        metadata = self.attn_backend.build_metadata(AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64),
            block_tables=as_tensor(block_tables),
            query_start_loc=as_tensor(query_start_loc),
            seq_lens=as_tensor(seq_lens),
        ))
        inputs = dict(
            input_ids=as_tensor([input_ids], torch.int64),
            position_ids=as_tensor([positions], torch.int64),
            attn_backend=self.attn_backend,
            attn_metadata=metadata,
        )
        return inputs, logits_indices, samplers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step: pack the inputs, run the forward pass, sample."""
        if not scheduler_output.scheduled:
            return self.kv_connector_no_forward(scheduler_output)
        return self.execute_step(self.prepare_step(scheduler_output))

    def execute_step(self, step: StepInputs) -> ModelRunnerOutput:
        """The forward pass and sampling of a packed step. With async scheduling the step
        was packed before the engine had seen the tokens of the step before it: each token
        it could not know (a placeholder, ``minivllm.core.async_scheduler``) is put into the
        inputs here, from what this runner sampled last. A request whose sampling failed
        there is finished by the engine; its row gets token 0, and its result is thrown
        away."""
        input_ids = step.inputs["input_ids"]
        for row, request_id in step.placeholders:
            input_ids[0, row] = self.last_sampled.get(request_id, [0])[-1]
        step.start = time.perf_counter()
        output = self.sample_step(step, self.forward(step))
        self.last_sampled = output.sampled
        return output

    def kv_connector_no_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step with nothing to compute while a KV connector loads in the background:
        start the loads the scheduler just asked for, and report those that arrived."""
        connector = self.kv_connector
        if connector is None or scheduler_output.kv_connector_metadata is None:
            raise RuntimeError("a step with nothing scheduled and no KV connector work: this is a bug")
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            connector.start_load_kv()
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        return ModelRunnerOutput(sampled={}, model_time=0.0, kv_connector_output=connector.get_finished())

    def prepare_step(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The step's flat batch and metadata, and which logits rows it keeps: the
        sampler's, then those of prompt positions whose logprobs are asked for."""
        inputs, logits_indices, requests = self.prepare_inputs(scheduler_output)
        sampling = SamplingMetadata.build(requests, prompt_logprob_rows(scheduler_output), self._generator)
        return StepInputs(inputs, logits_indices, sampling, time.perf_counter(),
                          scheduler_output.kv_connector_metadata, placeholder_rows(scheduler_output))

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """The forward pass: logits at the kept rows only, ``[rows, vocab]``."""
        keep = step.logits_indices + [row[1] for row in step.sampling.prompt_rows]
        if self.compiled is not None:
            return self._compiled_forward(step.inputs, keep)
        connector = self.kv_connector
        if connector is not None:  # loads before the forward pass, saves layer by layer in it
            connector.bind_connector_metadata(step.kv_connector_metadata)
            connector.start_load_kv()
        try:
            with planned_linear(self.linears):
                out = self.model(
                    **step.inputs,
                    use_cache=False,
                    logits_to_keep=torch.tensor(keep, dtype=torch.int64, device=self.device),
                    **({} if connector is None else {"kv_connector": connector}),
                )
            if connector is not None:
                connector.wait_for_save()
        finally:
            if connector is not None:
                connector.clear_connector_metadata()
        return out.logits[0]

    def _compiled_forward(self, inputs: dict, keep: list[int]) -> torch.Tensor:
        """The compiled model over this step, its attention through the forward context.
        The kept rows are padded to at least two (the last repeated) so that one row never
        specialises into a graph of its own (``minivllm.compilation``)."""
        padded = keep + keep[-1:] * (2 - len(keep))
        with forward_context(self.attn_backend, inputs["attn_metadata"]):
            out = self.compiled(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                                use_cache=False,
                                logits_to_keep=torch.tensor(padded, dtype=torch.int64, device=self.device))
        return out.logits[0, :len(keep)]

    def _dummy_forward(self, num_tokens: int) -> None:
        """A forward pass of one made-up sequence of ``num_tokens`` (the warm-up): its keys and
        values are not stored (slot -1) and it attends over block 0, whatever is there. Its
        inputs are made as :meth:`prepare_inputs` makes a step's (new tensors, not views, outside
        inference mode): the compiled graphs check that too, and would be traced again."""
        dev, bs = self.device, self.block_size
        metadata = self.attn_backend.build_metadata(AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((1, -(-num_tokens // bs)), dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev)))
        inputs = dict(input_ids=torch.zeros((1, num_tokens), dtype=torch.int64, device=dev),
                      position_ids=torch.tensor([list(range(num_tokens))], dtype=torch.int64, device=dev),
                      attn_metadata=metadata)
        with torch.inference_mode():
            self._compiled_forward(inputs, [num_tokens - 1])

    @torch.inference_mode()
    def sample_step(self, step: StepInputs, logits: torch.Tensor) -> ModelRunnerOutput:
        """Tokens (and logprobs) from the forward pass's logits."""
        md = step.sampling
        sampled, errors = self.sample(logits[:md.num_sample_rows], md)
        logprobs, prompt_logprobs = self.gather_logprobs(logits, md, sampled)
        return ModelRunnerOutput(sampled=sampled, errors=errors, model_time=time.perf_counter() - step.start,
                                 model_start=step.start,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 kv_connector_output=None if self.kv_connector is None
                                 else self.kv_connector.get_finished())

    def gather_logprobs(self, logits: torch.Tensor, md: SamplingMetadata, sampled: dict[str, list[int]]
                        ) -> tuple[dict[str, list[PositionLogprobs]], dict[str, list[PositionLogprobs]]]:
        """The logprobs of the requests that ask, from the rows of ``logits`` (the
        sampler's rows, then the prompt-logprob rows): one ``compute_logprobs`` for all.

        The rows are the raw model output, before logit_bias, penalties and temperature
        (vLLM's default ``logprobs_mode="raw_logprobs"``; ``minivllm.sample.logprobs``). With
        drafts, a request's row ``j`` scores its ``j``-th new token: each accepted draft,
        then the target's own token, are scored at their own positions exactly as if they
        had been generated one per step."""
        rows, tokens, num_top, owners = [], [], [], []
        for req, first in zip(md.requests, md.first_rows):
            k = req.sampling_params.logprobs
            if k is not None:
                for j, token in enumerate(sampled.get(req.request_id, [])):
                    rows.append(first + j)
                    tokens.append(token)
                    num_top.append(k)
                    owners.append((False, req.request_id))
        for m, (request_id, _, token, k) in enumerate(md.prompt_rows):
            rows.append(md.num_sample_rows + m)
            tokens.append(token)
            num_top.append(k)
            owners.append((True, request_id))
        if not rows:
            return {}, {}
        values = compute_logprobs(logits[rows], tokens, num_top)
        out: tuple[dict, dict] = ({}, {})
        for (is_prompt, request_id), position in zip(owners, values):
            out[is_prompt].setdefault(request_id, []).append(position)
        return out

    def sample(self, logits: torch.Tensor, md: SamplingMetadata
               ) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Requests without drafts go through the sampler together, one row each; a
        request with k drafts owns k + 1 consecutive rows and goes through the rejection
        sampler. Both see the logits after ``logit_bias``, the penalties and the grammar
        masks of requests with structured output
        (:func:`~minivllm.sample.sampler.apply_logits_processors`). Returns each request's new
        tokens, and the requests whose sampling failed with why (isolated to them)."""
        logits = apply_logits_processors(logits, md.row_params, md.row_prompts, md.row_outputs,
                                         grammars=md.grammars)
        plain = [i for i, d in enumerate(md.drafts) if not d]
        sampled: dict[str, list[int]] = {}
        errors: dict[str, str] = {}
        for i, (req, drafts) in enumerate(zip(md.requests, md.drafts)):
            if drafts:
                try:
                    sampled[req.request_id] = self.rejection_sampler(
                        logits[md.rows_of(i)], drafts, req.sampling_params,
                        md.generators[i] or self.sampler.generator)
                except Exception as e:  # isolated to this request, as in the sampler
                    errors[req.request_id] = str(e) if isinstance(e, SamplingError) else \
                        f"sampling failed: {type(e).__name__}: {e}"
        if plain:
            # The sampler gives one token per row, or a row's SamplingError in its place.
            tokens = self.sampler(logits[[md.first_rows[i] for i in plain]],
                                  [md.requests[i].sampling_params for i in plain],
                                  [md.generators[i] for i in plain])
            for i, t in zip(plain, tokens):
                if isinstance(t, Exception):
                    errors[md.requests[i].request_id] = str(t)
                else:
                    sampled[md.requests[i].request_id] = [t]
        return sampled, errors
