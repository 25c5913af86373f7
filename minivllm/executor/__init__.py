"""Executors (vLLM: ``vllm/v1/executor/``): what runs the model for the engine core.

``abstract.py``: the interface and the one-process executor; ``multiproc_executor.py``:
tensor parallelism, with worker processes for ranks 1..T-1 (notebook 14).
"""
