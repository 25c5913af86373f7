"""Entry points: what a user calls (vLLM: ``vllm/entrypoints/``).

The offline :class:`~minivllm.entrypoints.llm.LLM`, the ``minivllm`` command line
(``cli.py``), the OpenAI-compatible server (``openai/``) and the router in front of
several servers (``router.py``, ``routing.py``, ``data_parallel.py``).
"""
