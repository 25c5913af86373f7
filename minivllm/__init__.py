"""minivllm: a small, readable vLLM-style serving engine for learning.

    from minivllm import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)

The names below are imported when first used (PEP 562's module ``__getattr__``, as
vLLM's own ``__init__`` does), so that importing one part of the package, such as
``minivllm.core.scheduler``, does not load torch and transformers with the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineConfig": "minivllm.config",
    "SamplingParams": "minivllm.sampling_params",
    "StructuredOutputsParams": "minivllm.sample.structured_output",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
