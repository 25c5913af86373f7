"""Paged attention kernels (vLLM: ``vllm/v1/attention/ops/`` and ``csrc/``).

``reference.py`` is plain PyTorch (and the engine's CPU attention path); the Triton
kernels beside it are checked against it, in the order a reader meets them:
``triton_reshape_and_cache.py`` (KV store), ``paged_attention_v1.py`` (decode, one
program per query head), ``paged_attention_v2.py`` (unified, GQA-aware; the engine's
``attention_backend="triton"``), ``bench_paged_attention.py``. Those import triton, so
nothing here imports them: ``import minivllm.kernels`` works where triton is not
installed (``triton_utils.triton_available()`` tells). On a CPU, set
``TRITON_INTERPRET=1`` before triton is first imported (see ``triton_utils``).
"""
