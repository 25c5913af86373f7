"""minivllm: a small, readable vLLM-style serving engine."""
