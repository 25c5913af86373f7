"""The engine (vLLM: ``vllm/v1/engine/``): requests in, outputs out.

``processor.py`` checks and admits a request; ``core.py`` (``EngineCore``) schedules and
runs one step, returning each request's new tokens; ``output_processor.py`` turns those
into text and ``RequestOutput`` objects; ``llm_engine.py`` puts the three together for one
process; ``async_llm.py`` is the front end of a server, driving an engine core through a
client (``core_client.py``, ``mp_client.py``) in this process or another (``core_proc.py``).
"""
