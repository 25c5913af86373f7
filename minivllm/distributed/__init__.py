"""Tensor parallelism: one model split across several processes (notebook 14).

Three modules, named as in vLLM (``vllm/distributed/`` and ``vllm/v1/executor/``):

- :mod:`~minivllm.distributed.parallel_state`: the process group (torch.distributed, gloo
  on a CPU, NCCL on GPUs) and the all-reduce, timed;
- :mod:`~minivllm.distributed.tensor_parallel`: which weights each rank keeps, applied to
  the stock transformers model in place (column- and row-parallel linear layers);
- :mod:`~minivllm.distributed.executor`: the worker processes, and the step inputs
  rank 0 broadcasts to them.
"""
