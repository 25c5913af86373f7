"""Tensor parallelism: one model split across several processes (notebook 14).

Two modules, named as in vLLM (``vllm/distributed/``):

- :mod:`~minivllm.distributed.parallel_state`: the process group (torch.distributed, gloo
  on a CPU, NCCL on GPUs) and the all-reduce, timed;
- :mod:`~minivllm.distributed.tensor_parallel`: which weights each rank keeps, applied to
  the stock transformers model in place (column- and row-parallel linear layers).

The worker processes, and the step inputs rank 0 broadcasts to them, are the executor's
(:mod:`~minivllm.executor.multiproc_executor`, as ``vllm/v1/executor/``).

:mod:`~minivllm.distributed.kv_transfer` is the other thing vLLM keeps here: the KV
connector, through which KV blocks leave an engine and come back (offloading to RAM and
disk today; to another engine in disaggregated prefill).
"""
