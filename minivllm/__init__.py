"""minivllm: a small, readable vLLM-style serving engine for learning.

    from minivllm import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from minivllm.engine import EngineConfig, LLMEngine
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
