"""Utilities (vLLM: ``vllm/utils/``)."""
