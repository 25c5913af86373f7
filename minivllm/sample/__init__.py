"""Sampling (vLLM: ``vllm/v1/sample/``): the sampler, the per-step sampling metadata,
logprobs and structured output (grammar masks).
"""
