"""EngineConfig: every setting of the engine, in one place, with vLLM's names.

Settings listed in several places drift apart, so each is written down once, here, with
its default and a line of help, and everything else is made from that:

* ``LLM(...)`` keeps explicit keyword arguments (a learner reads them in the signature);
  a test checks that they are exactly these fields with these defaults.
* The command line's engine flags (``minivllm serve``, ``generate``, ``bench``) are made
  from the fields by ``minivllm.engine.arg_utils.add_engine_arguments``, help text included.
* The KV cache is sized from the settings by one function,
  ``minivllm.core.kv_cache_utils.size_kv_cache``, which the engine and the simulator
  both call.

It imports nothing else of minivllm but its exceptions: every module may read it. The
names a setting takes (attention and linear backends, scheduling policies) are defined
here, and their modules read them from here.

In vLLM: ``vllm/config/`` (``CacheConfig``, ``SchedulerConfig``, ...) and
``vllm/engine/arg_utils.py`` (``EngineArgs.add_cli_args`` makes the flags from the fields).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minivllm.exceptions import (
    ValidationError,
    ValidationTypeError,
    check_bool,
    check_float,
    check_int,
    check_keys,
)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The embedded model (``minivllm.worker.model_loader.EMBEDDED_MODELS``)."""
BACKENDS = ("auto", "torch", "triton")
"""The attention backends by name (``minivllm.worker.attention``)."""
LINEAR_BACKENDS = ("auto", "onednn", "torch", "transposed")
"""The libraries the linear layers may run on (``minivllm.worker.linear``)."""
SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's two policies: first come first served, or by each request's ``priority``."""
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")
"""vLLM's names for who starts the tensor-parallel ranks (``minivllm.executor``)."""
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds are signed 64-bit integers, as in OpenAI's API (torch accepts this range)."""
QUANTIZATION_METHODS = ("int8",)
"""What ``quantization`` may name (``minivllm.worker.quantization``); None keeps the weights as they are."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""What the KV cache may be stored in (``minivllm.worker.kv_cache_quant``): "auto" is the model's dtype."""
DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""The dtypes the weights and KV cache may take (``minivllm.executor.abstract.DTYPES`` maps them to torch's)."""
COMPILATION_MODES = {0: "NONE", 3: "VLLM_COMPILE"}
"""vLLM's ``CompilationMode`` values minivllm runs: 0, the model as it is (eager); 3, the model
compiled with torch.compile around an opaque attention op (``minivllm.compilation``)."""
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: about 23k tokens of SmolLM2-135M in float32


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field of :class:`EngineConfig`: its default, and the help its flag shows."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    """Every knob of the engine, with vLLM's names."""

    model: str = setting(DEFAULT_MODEL, "an embedded model name or a local Hugging Face folder")
    block_size: int = setting(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = setting(None, "exact number of KV blocks; overrides kv_cache_memory")
    kv_cache_memory: int | None = setting(
        None, "bytes for the KV cache (default 1 GiB, or what max_num_seqs full-length "
              "requests need if less)")
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int = setting(
        512, "token budget of one step: prompt and decode tokens together")
    max_model_len: int | None = setting(
        None, "longest request, prompt plus output (default: what the model and the KV cache allow)")
    enable_chunked_prefill: bool = setting(
        True, "cut long prompts into chunks that share steps with decodes")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes seen before")
    scheduling_policy: str = setting(
        "fcfs", "'fcfs': first come, first served; 'priority': by each request's priority "
                "(lower first, then arrival), and preemption takes the least important",
        SCHEDULING_POLICIES)
    attention_backend: str | type = setting(
        "auto", "'torch' (the PyTorch reference), 'triton', 'auto' (Triton on CUDA, PyTorch "
                "elsewhere), or an AttentionBackend class: a class, 'module:Class' or "
                "'path/to/file.py:Class'")
    linear_backend: str = setting(
        "auto", "'auto': on a CPU, per row count the library that measured fastest here "
                "(minivllm.worker.linear; measured once, then cached); 'torch': nn.Linear as it is; "
                "'onednn', 'transposed': one library for every product", LINEAR_BACKENDS)
    dtype: str = setting("float32", "dtype of the weights and the KV cache", DTYPE_NAMES)
    quantization: str | None = setting(
        None, "'int8': every linear layer's weight in int8 (one scale per output row), "
              "multiplied by activations rounded to int8 per token at each call, in integers "
              "(torch._int_mm), after SmoothQuant's smoothing calibrated at load "
              "(minivllm.worker.quantization; CPU, float32 only)",
        QUANTIZATION_METHODS)
    kv_cache_dtype: str = setting(
        "auto", "'auto': the KV cache in the model's dtype; 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2': "
                "one byte per value, with a scale per layer for keys and one for values measured "
                "at load (minivllm.worker.kv_cache_quant)", KV_CACHE_DTYPES)
    device: str = setting("auto", "'auto': CUDA when there is one, else the CPU")
    seed: int = setting(0, "seed of the generator that random requests without their own seed draw from")
    max_trace_steps: int | None = setting(
        None, "keep only this many most recent steps in the trace (default: all)")
    log_stats_interval: float | None = setting(
        5.0, "seconds between throughput/KV-usage log lines on the 'minivllm' logger (0: off)")
    scheduler_cls: str | type = setting(
        "minivllm.core.scheduler:Scheduler",
        "the scheduler class: a class, 'module:Class' or 'path/to/file.py:Class' "
        "(build your own and plug it in; vLLM: --scheduler-cls)")
    kv_cache_manager_cls: str | type = setting(
        "minivllm.core.kv_cache_manager:KVCacheManager",
        "the KV cache manager class: a class, 'module:Class' or 'path/to/file.py:Class'")
    block_pool_cls: str | type = setting(
        "minivllm.core.block_pool:BlockPool",
        "the block pool class the KV cache manager builds: a class, 'module:Class' or "
        "'path/to/file.py:Class'")
    sampler_cls: str | type = setting(
        "minivllm.sample.sampler:Sampler",
        "the sampler class: a class, 'module:Class' or 'path/to/file.py:Class'")
    tensor_parallel_size: int = setting(
        1, "split the model across this many processes (rank 0 is the engine's own), by "
           "attention heads and MLP slices, joined by torch.distributed (gloo on a CPU, NCCL "
           "on GPUs, one per rank; minivllm.distributed); must divide the query and KV heads")
    distributed_executor_backend: str = setting(
        "mp", "how the tensor-parallel ranks 1..T-1 are started: 'mp', worker processes on this "
              "machine; 'ray', Ray actors placed on the nodes of a Ray cluster "
              '(pip install "minivllm[ray]"; minivllm.executor.ray_distributed_executor); '
              "'uni': one process (tensor_parallel_size 1 only)", DISTRIBUTED_EXECUTOR_BACKENDS)
    kv_transfer_config: dict | None = setting(
        None, "a KV connector, as vLLM takes it: a dict (JSON on the command line) such as "
              '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
              '"kv_connector_extra_config": {"num_cpu_blocks": 512, "disk_path": "kv", '
              '"num_disk_blocks": 4096}}: prefix-cache blocks spill to RAM and disk and come '
              "back as hits (minivllm.distributed.kv_transfer)")
    speculative_config: dict | None = setting(
        None, "speculative decoding, as vLLM takes it: a dict (JSON on the command line) such as "
              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
              '"prompt_lookup_min": 1} (minivllm.spec_decode); minivllm adds "adaptive" (default '
              'false; true: verify as many drafts as it measured to pay at this batch size)')
    compilation_config: dict | int | None = setting(
        None, "torch.compile, as vLLM takes it: a mode number (on the command line: "
              '--compilation-config 3) or a dict such as {"mode": 3, "backend": "inductor"}; mode 3 '
              "compiles the model around an opaque attention op (minivllm.compilation), mode 0 "
              "runs it eagerly. Default (None): mode 0, unlike vLLM, because on a CPU compiling "
              "costs about a minute at start for a gain of a few percent (README)")
    enforce_eager: bool = setting(
        False, "never compile: the model runs eagerly whatever compilation_config says (vLLM's flag)")
    async_scheduling: bool = setting(
        False, "schedule the next step and process the last one's tokens while the model runs "
               "(vLLM's flag; minivllm.core.async_scheduler): greedy tokens are the same; a request "
               "that stops computes one token more, thrown away. Not with tensor parallelism, "
               "speculative decoding or a KV connector")

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every knob's type and range; raise ValidationError naming the first bad one.
        (What depends on the model, such as max_model_len against the KV cache, is
        checked by :func:`size_kv_cache` when the engine is built.)"""
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
        for f in dataclasses.fields(self):
            allowed, value = f.metadata["choices"], getattr(self, f.name)
            if allowed is not None and value not in allowed and not (value is None and f.default is None):
                raise ValidationError(f.name, f"{f.name} must be one of {allowed}, got {value!r}", value)
        if not isinstance(self.device, str):
            raise ValidationTypeError("device", f"device must be a string such as 'cpu', 'cuda' or "
                                      f"'auto', got {self.device!r}", self.device)
        self.seed = check_int("seed", self.seed, minimum=SEED_MIN, maximum=SEED_MAX)
        self.tensor_parallel_size = check_int("tensor_parallel_size", self.tensor_parallel_size,
                                              minimum=1)
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValidationError("distributed_executor_backend", "distributed_executor_backend 'uni' "
                                  "runs one process: it cannot run tensor_parallel_size "
                                  f"{self.tensor_parallel_size}; use 'mp' or 'ray'", "uni")
        self.max_trace_steps = check_int("max_trace_steps", self.max_trace_steps, minimum=1,
                                         optional=True)
        self.log_stats_interval = check_float("log_stats_interval", self.log_stats_interval,
                                              minimum=0, optional=True)
        if self.speculative_config is not None:  # checked here, read as a SpeculativeConfig
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config).as_dict()
        self.enforce_eager = check_bool("enforce_eager", self.enforce_eager)
        self.async_scheduling = check_bool("async_scheduling", self.async_scheduling)
        if self.async_scheduling:
            for name, on, what in (
                    ("tensor_parallel_size", self.tensor_parallel_size > 1, "tensor parallelism"),
                    ("speculative_config", self.speculative_config is not None,
                     "speculative decoding (drafts are proposed from the tokens of the step before)"),
                    ("kv_transfer_config", self.kv_transfer_config is not None, "a KV connector")):
                if on:
                    raise ValidationError(name, f"async_scheduling does not run with {what}; "
                                          "set async_scheduling=False", getattr(self, name))
        if self.compilation_config is not None:  # checked here, read as a CompilationConfig
            self.compilation_config = CompilationConfig.parse(self.compilation_config).as_dict()
        if self.kv_transfer_config is not None:  # checked here, read as a KVTransferConfig
            self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config).as_dict()
            if not self.enable_prefix_caching:
                raise ValidationError("kv_transfer_config", "the KV connector finds blocks by their "
                                      "prefix-cache hashes: it needs enable_prefix_caching=True",
                                      self.kv_transfer_config)
        for name in COMPONENT_FIELDS:
            spec = getattr(self, name)
            if name == "attention_backend" and spec in BACKENDS:
                continue
            if not (isinstance(spec, str) and ":" in spec or callable(spec)):
                names = f"one of {BACKENDS}, " if name == "attention_backend" else ""
                raise ValidationTypeError(
                    name, f"{name} must be {names}a class, 'module:Class' or "
                          f"'path/to/file.py:Class', got {spec!r}", spec)


@dataclass(frozen=True)
class CompilationConfig:
    """torch.compile's settings, with vLLM's names (``vllm/config/compilation.py``).

    vLLM also captures CUDA graphs (``cudagraph_mode``, ``cudagraph_capture_sizes``); a
    CPU has no graphs to capture, and those keys are refused rather than ignored."""

    mode: int = 0
    """0 (NONE): eager; 3 (VLLM_COMPILE): compiled (:data:`COMPILATION_MODES`)."""
    backend: str = "inductor"
    """torch.compile's backend: "inductor" generates fused C++ (on a CPU) or Triton (on a
    GPU) code; "eager" only traces the graph and runs it op by op (a check that the
    model compiles, in seconds)."""

    @classmethod
    def parse(cls, value: Any) -> CompilationConfig:
        """From vLLM's forms: a mode number, or a dict with "mode" (or its older name
        "level") and "backend"; other keys are refused, naming the known ones."""
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            value = {"mode": value}
        if not isinstance(value, dict):
            raise ValidationTypeError(
                "compilation_config", f"compilation_config must be a mode number (0 or 3) or a dict "
                f'such as {{"mode": 3}}, got {value!r}', value)
        check_keys("compilation_config", value, ("mode", "level", "backend"))
        if "mode" in value and "level" in value:
            raise ValidationError("compilation_config", "compilation_config: give mode or its older "
                                  "name level, not both", value)
        mode = check_int("mode", value.get("mode", value.get("level", 0)))
        if mode not in COMPILATION_MODES:
            raise ValidationError(
                "compilation_config", f"compilation_config mode must be one of "
                f"{', '.join(f'{k} ({v})' for k, v in COMPILATION_MODES.items())}, got {mode} (vLLM's "
                "modes 1 and 2, stock torch.compile and trace-once, are not built here)", value)
        backend = value.get("backend", "inductor")
        if backend not in ("inductor", "eager"):
            raise ValidationError("compilation_config", f"compilation_config backend must be "
                                  f"'inductor' or 'eager', got {backend!r}", value)
        return cls(mode, backend)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings, with vLLM's names (``vllm/config/speculative.py``).

    Only the n-gram ("prompt lookup") method exists here: no draft model, the drafts are
    copied from earlier in the request's own tokens (``minivllm.spec_decode.ngram_proposer``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    """k: the most draft tokens proposed (and verified) per request per step."""
    prompt_lookup_max: int = 4
    """The longest suffix n-gram looked up."""
    prompt_lookup_min: int = 1
    """The shortest suffix n-gram that may match; below it nothing is proposed."""
    adaptive: bool = False
    """minivllm's own key (vLLM has none like it), off by default: at each batch size,
    verify the number of drafts (0, about k/2 or k) that the engine has measured to give
    the most tokens per second (``minivllm.spec_decode.draft_length``). False: always up
    to k, as vLLM does."""
    disable_by_batch_size: int | None = None
    """vLLM's key: no drafts at all while more than this many requests are running."""

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """From vLLM's dict form (or a SpeculativeConfig); every key checked, unknown ones
        refused, so a typo is an error rather than a silently default setting."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValidationTypeError(
                "speculative_config", f"speculative_config must be a dict such as "
                f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r}', value)
        check_keys("speculative_config", value, {f.name for f in dataclasses.fields(cls)})
        if "num_speculative_tokens" not in value:
            raise ValidationError("speculative_config",
                                  "speculative_config needs num_speculative_tokens", value)
        method = value.get("method", "ngram")
        if method != "ngram":
            raise ValidationError("speculative_config", f"speculative_config method must be 'ngram' "
                                  f"(the only one minivllm has), got {method!r}", value)
        k = check_int("num_speculative_tokens", value["num_speculative_tokens"], minimum=1)
        hi = check_int("prompt_lookup_max", value.get("prompt_lookup_max", 4), minimum=1)
        lo = check_int("prompt_lookup_min", value.get("prompt_lookup_min", 1), minimum=1)
        if lo > hi:
            raise ValidationError("prompt_lookup_min", f"prompt_lookup_min {lo} is more than "
                                  f"prompt_lookup_max {hi}", lo)
        adaptive = check_bool("adaptive", value.get("adaptive", False))
        disable = check_int("disable_by_batch_size", value.get("disable_by_batch_size"), minimum=1,
                            optional=True)
        return cls(method, k, hi, lo, adaptive, disable)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


KV_CONNECTORS = ("OffloadingConnector", "ExampleConnector", "SharedStorageConnector")
"""The KV connectors minivllm has (``minivllm.distributed.kv_transfer``). "ExampleConnector"
and "SharedStorageConnector" name the same one: vLLM renamed its shared-folder example
connector in December 2025 (vllm#30201), and configurations written before still use the
old name, which both vLLM's history and this engine accept."""
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector's settings, with vLLM's names (``vllm/config/kv_transfer.py``).

    ``kv_connector`` names the connector; ``kv_role`` says whether this engine saves KV
    ("kv_producer"), loads it ("kv_consumer") or both; ``kv_connector_extra_config`` is
    the connector's own settings, checked by the connector."""

    kv_connector: str = "OffloadingConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig:
        """From vLLM's dict form; unknown keys and names refused, naming the field."""
        if isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValidationTypeError(
                "kv_transfer_config", f"kv_transfer_config must be a dict such as "
                f'{{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}}, got {value!r}', value)
        check_keys("kv_transfer_config", value, {f.name for f in dataclasses.fields(cls)})
        for key, allowed in (("kv_connector", KV_CONNECTORS), ("kv_role", KV_ROLES)):
            if value.get(key, getattr(cls, key)) not in allowed:
                raise ValidationError(key, f"{key} must be one of {allowed}, got {value[key]!r}", value[key])
        extra = value.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValidationTypeError("kv_connector_extra_config", "kv_connector_extra_config must be "
                                      f"a dict, got {extra!r}", extra)
        return cls(value.get("kv_connector", cls.kv_connector), value.get("kv_role", cls.kv_role),
                   dict(extra))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


COMPONENT_FIELDS = ("scheduler_cls", "kv_cache_manager_cls", "block_pool_cls", "sampler_cls",
                    "attention_backend")
"""The engine's parts that a learner can replace with their own class (the
build-it-yourself track, ``build_it_yourself/``; ``minivllm check`` runs the engine's
tests on one). The defaults are names too, loaded by :func:`load_component` like a
learner's ("auto", "torch" and "triton" name the attention backends' classes,
:data:`minivllm.worker.attention.BACKEND_CLASSES`), so every engine the test suite builds goes
through the same hook."""


def load_component(name: str, spec: str | type) -> Any:
    """The class a component field names: given as is, or imported from 'module:Class'
    or 'path/to/file.py:Class' (a file that is not on the import path: a learner's own).
    Anything that cannot be found is a ValidationError naming the field."""
    if not isinstance(spec, str):
        return spec
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            module_spec = importlib.util.spec_from_file_location(f"minivllm_user_{path.stem}", path)
            if module_spec is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, attr)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise ValidationError(name, f"{name} {spec!r} cannot be loaded: {e}", spec) from e


