"""Paged attention kernels, installed as ``minivllm.kernels``.

``reference.py`` is plain PyTorch (and the engine's CPU attention path); the Triton
kernels beside it are checked against it. The folder is not a top-level ``kernels``
package on purpose: Hugging Face publishes one of that name, which transformers imports.
"""
