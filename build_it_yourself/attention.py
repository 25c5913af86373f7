"""Build it yourself, piece 6: the reference paged attention.

Read first: notebook 05 (paged attention: the reference, then the Triton kernels).
Check:      minivllm check attention build_it_yourself/attention.py:MyAttentionBackend
Solution:   minivllm/kernels/reference.py (minivllm.kernels.reference:
            reshape_and_cache, paged_attention) behind TorchAttentionBackend in
            minivllm/worker/attention.py

Every layer of the model hands the backend this step's queries, keys and values for the
whole flat batch (every scheduled token of every request, concatenated). The backend
stores the new keys and values in the paged cache, then attends over the cache. One
layer's cache is ``key_cache`` and ``value_cache``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]``; token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``.

``metadata`` (an ``AttentionMetadata``) says where everything is:
``slot_mapping`` ``[num_tokens]`` (flat slot ``block_id * block_size + offset`` of each new
token), ``block_tables`` ``[num_seqs, max_blocks]``, ``query_start_loc`` ``[num_seqs + 1]``
(sequence ``s``'s queries are rows ``query_start_loc[s]:query_start_loc[s + 1]``) and
``seq_lens`` ``[num_seqs]`` (tokens in the cache for each sequence *after* this step).

A plain loop over sequences is the right first version (a few lines with
``torch.nn.functional.scaled_dot_product_attention``); the engine's reference batches the
decodes, which you can read once yours passes.
"""

from __future__ import annotations

import torch

from minivllm.worker.attention import AttentionBackend, AttentionMetadata


class MyAttentionBackend(AttentionBackend):
    name = "mine"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Store ``key`` and ``value`` (``[num_tokens, num_kv_heads, head_dim]``) at the
        slots ``metadata.slot_mapping`` names. Hint: ``key_cache.view(-1, num_kv_heads,
        head_dim)`` is the cache as one row per slot (a view: writing to it writes the
        cache); cast to the cache's dtype."""
        raise NotImplementedError("MyAttentionBackend.write_kv: store the new keys and values "
                                  "at their slots (see its docstring)")

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of ``query`` (``[num_tokens, num_heads, head_dim]``) over the
        cache; returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.

        For each sequence ``s`` with ``q_len`` queries and ``seq_len = seq_lens[s]``:

        - gather its keys and values, positions ``0 .. seq_len - 1``, through
          ``block_tables[s]`` (only the first ``ceil(seq_len / block_size)`` entries are
          its blocks; the rest is padding);
        - its queries are its *last* ``q_len`` positions: query ``i`` sits at position
          ``seq_len - q_len + i`` and may attend to keys at positions ``<=`` its own
          (a whole prompt: ``q_len == seq_len``; a chunk after cached context or a
          decode: ``q_len < seq_len``);
        - grouped-query attention: ``num_heads`` is a multiple of ``num_kv_heads``;
          query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``
          (``enable_gqa=True`` in SDPA, or ``repeat_interleave``);
        - softmax scale ``scale``.
        """
        raise NotImplementedError("MyAttentionBackend.attend: gather each sequence's K/V "
                                  "through its block table, attend causally (see its docstring)")
