"""Executor: what runs the model for the engine, in one process or several (notebook 14).

The engine never calls a model runner itself. It hands each step's ``SchedulerOutput``
to its executor and gets a ``ModelRunnerOutput`` back; how many processes took part is
the executor's business:

* :class:`UniProcExecutor`: one model runner, in the engine's own process (the default).
* :class:`~minivllm.executor.multiproc_executor.MultiprocExecutor`: with tensor parallelism,
  rank 0's model runner here and ranks 1..T-1 in worker processes, each step's inputs
  broadcast to them around rank 0's forward pass.
* :class:`~minivllm.executor.ray_distributed_executor.RayDistributedExecutor`: the same
  step, with ranks 1..T-1 as Ray actors on any node of a Ray cluster
  (``distributed_executor_backend="ray"``).

So the model runner, the module learners read most, holds no distributed code. Before
any of them exists, :func:`load_model_for` turns the config's names into things: the device,
the dtype, the attention backend's class, the model and its linear-layer plan.

In vLLM: ``vllm/v1/executor/abstract.py`` (``Executor``), ``uniproc_executor.py``,
``multiproc_executor.py`` and ``ray_executor.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from minivllm.config import DTYPE_NAMES, CompilationConfig, EngineConfig, load_component
from minivllm.core.scheduler import SchedulerOutput
from minivllm.distributed.tensor_parallel import check_tensor_parallel_size
from minivllm.exceptions import ValidationError
from minivllm.worker.attention import BACKEND_CLASSES, BACKENDS, resolve_backend
from minivllm.worker.kv_cache_quant import (
    KVCacheQuantization,
    calibrate_kv_scales,
    check_kv_cache_dtype,
)
from minivllm.worker.linear import choose_linear_plan
from minivllm.worker.linear_plan import STOCK_PLAN, LinearPlan, resolve_linear_backend
from minivllm.worker.model_loader import load_model
from minivllm.worker.model_runner import ModelRunner, ModelRunnerOutput, StepInputs
from minivllm.worker.quantization import (
    QuantizationReport,
    calibration_prompts,
    check_quantization,
    quantize_model,
)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class Executor:
    """The interface the engine uses: run a step, forget finished requests, shut down."""

    model_runner: ModelRunner
    """The runner in the engine's process (rank 0's, with tensor parallelism)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def prepare_step(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Async scheduling's first half of :meth:`execute_model`: pack a step's inputs
        now (from the scheduler's state as the step left it), to run later with
        :meth:`execute_step`. Only :class:`UniProcExecutor` splits a step so."""
        raise NotImplementedError(f"{type(self).__name__} runs each step whole (no async scheduling)")

    def execute_step(self, step: StepInputs) -> ModelRunnerOutput:
        """Async scheduling's second half: the forward pass and sampling of a packed step."""
        raise NotImplementedError(f"{type(self).__name__} runs each step whole (no async scheduling)")

    def remove_requests(self, request_ids: list[str]) -> None:
        """Forget what the runner keeps for these requests (they have finished)."""
        self.model_runner.remove_requests(request_ids)

    def shutdown(self) -> None:
        """Release what the executor started (idempotent); nothing for one process."""


class UniProcExecutor(Executor):
    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner

    def prepare_step(self, scheduler_output: SchedulerOutput) -> StepInputs:
        return self.model_runner.prepare_step(scheduler_output)

    def execute_step(self, step: StepInputs) -> ModelRunnerOutput:
        return self.model_runner.execute_step(step)


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
class LoadedModel:
    """The model and everything resolved to run it (:func:`load_model_for`)."""
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    device: torch.device
    dtype: torch.dtype
    attention_backend_cls: type
    attention_backend: str
    """Its name ("torch", "triton") for logs and benchmark records; a learner's class
    that names none is called by its class name."""
    linear_plan: LinearPlan
    eos_token_id: int | None
    quantization: QuantizationReport | None = None
    """What ``quantization`` converted (None: the weights as loaded)."""
    kv_cache: KVCacheQuantization | None = None
    """An 8-bit KV cache's dtype and scales (None: the cache in the model's dtype)."""
    compilation: CompilationConfig | None = None
    """How the model is compiled (None: it runs eagerly)."""


def load_model_for(config: EngineConfig, model: PreTrainedModel | None = None,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> LoadedModel:
    """Device, dtype and backends from the config; the model (loaded when not given).
    A backend this machine cannot run is refused here, naming its field."""
    dtype, device = DTYPES[config.dtype], resolve_device(config.device)
    spec = config.attention_backend
    if isinstance(spec, str) and spec in BACKENDS:
        try:
            spec = BACKEND_CLASSES[resolve_backend(spec, device)]
        except (ValueError, RuntimeError) as e:
            raise ValidationError("attention_backend", str(e), config.attention_backend) from None
    backend_cls = load_component("attention_backend", spec)  # through the build-it-yourself hook
    try:
        linear_backend = resolve_linear_backend(config.linear_backend, device, dtype)
    except ValueError as e:
        raise ValidationError("linear_backend", str(e), config.linear_backend) from None
    try:
        check_quantization(config.quantization, device, dtype, config.tensor_parallel_size)
    except ValueError as e:
        raise ValidationError("quantization", str(e), config.quantization) from None
    try:
        check_kv_cache_dtype(config.kv_cache_dtype, config.tensor_parallel_size)
    except ValueError as e:
        raise ValidationError("kv_cache_dtype", str(e), config.kv_cache_dtype) from None
    compilation = compilation_for(config, linear_backend)
    if config.distributed_executor_backend == "ray" and config.tensor_parallel_size > 1:
        from minivllm.executor.ray_utils import import_ray

        import_ray()  # refused before the model loads, naming the extra, if Ray is missing
    loaded_here = model is None
    if loaded_here:
        model, tokenizer = load_model(config.model, dtype, device)
    if config.tensor_parallel_size > 1:
        try:
            check_tensor_parallel_size(model.config, config.tensor_parallel_size)
        except ValueError as e:
            raise ValidationError("tensor_parallel_size", str(e), config.tensor_parallel_size) from None
    if not loaded_here:
        # Sharding and quantizing change the model in place: not the caller's.
        if config.tensor_parallel_size > 1 or config.quantization:
            model = copy.deepcopy(model)
        model = model.to(device=device, dtype=dtype).eval()
    report = kv_cache = None
    if config.quantization or config.kv_cache_dtype != "auto":
        calibration = calibration_prompts(tokenizer, model.config.vocab_size)
        model.set_attn_implementation("sdpa")  # stock transformers for the calibration runs
        if config.quantization:
            report = quantize_model(model, config.quantization, calibration)
        if config.kv_cache_dtype != "auto":  # measured on the model that will run
            kv_cache = calibrate_kv_scales(model, config.kv_cache_dtype, calibration)
    # "auto" becomes a plan measured on this machine (or read from its cache), for the
    # layers still in floating point; a compiled model's products are the calls inductor
    # chooses, so it has no plan.
    plan = STOCK_PLAN if compilation else choose_linear_plan(linear_backend, model)
    return LoadedModel(model, tokenizer, device, dtype, backend_cls,
                       getattr(backend_cls, "name", None) or backend_cls.__name__,
                       plan, eos_token_id(model, tokenizer), report, kv_cache, compilation)


def compilation_for(config: EngineConfig, linear_backend: str) -> CompilationConfig | None:
    """The compilation the settings ask for (None: eager), refusing, naming the field, what
    the compiled path does not run: tensor parallelism (its all-reduces sit between the
    layers), a KV connector (its per-layer hooks are Python objects) and a fixed linear
    library (the plan swaps the layers' class at run time, which a graph cannot follow)."""
    if config.enforce_eager or config.compilation_config is None:
        return None
    compilation = CompilationConfig.parse(config.compilation_config)
    if compilation.mode == 0:
        return None
    for field, bad, why in (
            ("tensor_parallel_size", config.tensor_parallel_size > 1, "tensor parallelism"),
            ("kv_transfer_config", config.kv_transfer_config is not None, "a KV connector"),
            ("linear_backend", linear_backend not in ("auto", "torch"),
             f"linear_backend {linear_backend!r} (a compiled model's products are the library calls "
             "inductor chooses; use 'auto' or 'torch')")):
        if bad:
            raise ValidationError(field, f"compilation_config mode {compilation.mode} does not run with {why}; "
                                  "set enforce_eager=True or compilation_config=0", getattr(config, field))
    return compilation


def eos_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """The token that ends a request: the model's generation config says, else the tokenizer."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos
