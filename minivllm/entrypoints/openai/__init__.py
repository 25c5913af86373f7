"""The OpenAI-compatible HTTP server (vLLM: ``vllm/entrypoints/openai/``), notebook 10.

``api_server.py`` builds the app, ``serving.py`` turns requests into engine calls and
engine outputs into responses, the ``*protocol.py`` modules are the request and response
bodies, ``middleware.py`` and ``prometheus.py`` what runs around every request.
"""
