"""Which weights each rank keeps: column- and row-parallel linear layers (Megatron-LM's split).

A decoder layer has two blocks, and each is split the same way, so that only one
all-reduce per block is needed::

    attention:  x --[q_proj k_proj v_proj]--> heads --attention--> [o_proj] --all-reduce--> y
                       column-parallel          (each rank its        row-parallel
                       (rows = output dims)      own heads)           (columns = input dims)
    MLP:        x --[gate_proj up_proj]--> act(gate) * up --[down_proj] --all-reduce--> y

- **Column-parallel** (q/k/v, gate/up): rank ``r`` keeps the ``r``-th contiguous slice
  of the weight's *rows*, that is of the layer's outputs. For q_proj the rows are ordered
  head by head, so a slice is a set of whole attention heads; for k/v_proj whole KV
  heads. With H query heads, K KV heads and T ranks, rank r has query heads
  ``[r H/T, (r+1) H/T)`` and KV heads ``[r K/T, (r+1) K/T)``: exactly the KV heads its
  query heads read (grouped-query attention keeps ``H/K`` query heads per KV head on
  every rank). Attention needs nothing from the other ranks: each head is independent.
  The input ``x`` is the same on every rank (replicated), so no communication here.
- **Row-parallel** (o_proj, down_proj): rank ``r`` keeps the matching slice of the
  weight's *columns* (its inputs), multiplies its own heads' (or its own slice of the
  MLP's intermediate) activations, and gets a *partial* sum of the output. The
  **all-reduce** adds the T partial sums: every rank then holds the full output, the
  same ``y`` as without tensor parallelism (up to the order of the additions).

So 2 all-reduces per decoder layer, each of ``num_tokens x hidden_size`` values.

**Applied to the stock transformers model without rewriting it.** The sharded layers
stay ``nn.Linear``; only their weights are replaced by slices. The all-reduce is a
forward hook on o_proj and down_proj (a hook's return value replaces the layer's
output). The attention module reshapes with ``-1`` heads
(``q_proj(x).view(*shape, -1, head_dim)`` and ``reshape(*shape, -1)`` before o_proj
in transformers' Llama, Qwen2 and Mistral), so it simply sees H/T heads; its
``num_key_value_groups`` (H/K) is unchanged by the split; minivllm's paged attention
reads the head counts from the tensors. The tests check the tokens against T=1 and
``generate()``.

**Replicated**: the embedding, the norms and lm_head. vLLM also splits the vocabulary
across ranks (``VocabParallelEmbedding``, ``ParallelLMHead``, then a gather of the
logits); minivllm keeps them whole on every rank for simplicity (they are a fifth of
SmolLM2-135M's weights), and only rank 0 computes the logits and samples.

In vLLM: ``vllm/model_executor/layers/linear.py`` (``ColumnParallelLinear``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``), which
the models are written with; here the stock layers are sliced after loading instead.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import TensorParallelGroup

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Split by output rows: each rank computes its own heads / its slice of the MLP."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Split by input columns, followed by an all-reduce of the output."""


def check_tensor_parallel_size(config, tensor_parallel_size: int) -> None:
    """Refuse a T that does not split the heads (and the MLP) evenly: a rank must hold
    whole heads, and the same number as every other rank."""
    t = tensor_parallel_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % t or kv_heads % t:
        divisors = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
        raise ValueError(
            f"tensor_parallel_size {t} does not divide the model's {heads} attention heads and "
            f"{kv_heads} KV heads (each rank must hold whole heads); use one of {divisors}")
    if config.intermediate_size % t:
        raise ValueError(f"tensor_parallel_size {t} does not divide the model's intermediate_size "
                         f"{config.intermediate_size}")


def _slice(param: torch.Tensor, dim: int, rank: int, world_size: int) -> nn.Parameter:
    # clone: the slice owns its memory, so the full weight can be freed.
    return nn.Parameter(param.detach().chunk(world_size, dim)[rank].clone(), requires_grad=False)


def shard_model(model: nn.Module, group: TensorParallelGroup) -> dict[str, list[str]]:
    """Keep this rank's slice of every column- and row-parallel layer of ``model`` (in
    place) and hook the all-reduce after each row-parallel one. Returns the sharded
    layer names by kind, for the notebook's picture of who holds what."""
    rank, t = group.rank, group.world_size
    done: dict[str, list[str]] = {"column": [], "row": []}

    def all_reduce_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if not isinstance(module, nn.Linear) or leaf not in COLUMN_PARALLEL + ROW_PARALLEL:
            continue
        if leaf in COLUMN_PARALLEL:
            module.weight = _slice(module.weight, 0, rank, t)
            if module.bias is not None:  # Qwen2's q/k/v biases: one per output row
                module.bias = _slice(module.bias, 0, rank, t)
            module.out_features = module.weight.shape[0]
            done["column"].append(name)
        else:
            module.weight = _slice(module.weight, 1, rank, t)
            if module.bias is not None and rank != 0:  # added once, not T times, by the sum
                module.bias = nn.Parameter(torch.zeros_like(module.bias), requires_grad=False)
            module.in_features = module.weight.shape[1]
            module.register_forward_hook(all_reduce_output)
            done["row"].append(name)
    return done


def heads_of_rank(config, rank: int, world_size: int) -> dict[str, range]:
    """Which query and KV heads rank ``rank`` holds (for a picture)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    q, k = heads // world_size, kv_heads // world_size
    return {"query_heads": range(rank * q, (rank + 1) * q), "kv_heads": range(rank * k, (rank + 1) * k)}
