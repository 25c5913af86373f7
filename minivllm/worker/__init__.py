"""The worker side (vLLM: ``vllm/v1/worker/`` and ``vllm/model_executor/``): the model
runner, the attention backends, the linear layers and the model loader.
"""
