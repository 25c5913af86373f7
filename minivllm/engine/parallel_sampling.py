"""Parallel sampling (``SamplingParams.n > 1``): one prompt, n completions, n child requests.

The scheduler, the KV cache manager and the model runner know nothing of ``n``: as in
vLLM V1, the front end fans a *parent* request out into n ordinary *child* requests and
gathers their outputs back into one ``RequestOutput`` per parent.

* **Fan out.** Child ``i`` of request ``"abc"`` is the request ``"i_abc"`` (vLLM's
  naming) with the parent's SamplingParams, ``n=1``, and, when the parent has a seed,
  ``seed + i``: the children must not all draw the same tokens, and child ``i`` samples
  exactly what a request of its own with ``seed + i`` would (vLLM's rule).
* **Share the prompt.** The children have the same prompt, so with prefix caching their
  prompt's *full* blocks are computed once and shared (ref counts). The children are
  admitted in the same step; the first registers the hashes of the blocks its prefill
  will fill as soon as it is scheduled (``KVCacheManager.cache_blocks``), so the
  next ones, admitted right after it in the same step, already hit them: the model
  runner writes a layer's K/V for the whole batch before any attention in that layer
  reads it. The partial last block of the prompt is never shared (only full blocks are
  hashed): each child writes its own copy of it, and its own blocks from there on.
* **Gather.** Each step the children's outputs become one output of the parent: its
  ``outputs`` hold all n ``CompletionOutput`` (``index`` 0..n-1, each as it stands:
  cumulative text and token ids, its own finish reason), and it is ``finished`` when all
  n are. A completion's text only ever grows, so a streaming client takes the new part of
  each (``RequestOutput.new_text`` is for one completion and stays empty for n > 1).
* **Abort.** Aborting the parent aborts every child still running.

In vLLM: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``), used by
``LLMEngine.add_request``/``AsyncLLM.add_request`` and the ``OutputProcessor``.
"""

from __future__ import annotations

import dataclasses

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    """vLLM's name for child ``index`` of ``request_id``."""
    return f"{index}_{request_id}"


class ParentRequest:
    """A request with ``n > 1``: its children's ids and params, and their latest outputs."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_ids = [child_request_id(i, request_id) for i in range(params.n)]
        self._index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.completions = [CompletionOutput(i, "", []) for i in range(params.n)]
        """The latest CompletionOutput of each child, by index."""
        self.unfinished = set(self.child_ids)
        self._last: RequestOutput | None = None
        self._num_cached_tokens = 0
        self._prompt_logprobs = None
        """With ``prompt_logprobs``: the first child's to have them all (the prompt is the
        same for every child, and so are they)."""

    @property
    def n(self) -> int:
        return self.params.n

    def child_params(self, index: int) -> SamplingParams:
        """The parent's params with ``n=1`` and, if it has a seed, ``seed + index``."""
        seed = self.params.seed
        return dataclasses.replace(self.params, n=1, seed=None if seed is None else seed + index)

    def children(self) -> list[tuple[str, SamplingParams]]:
        return [(cid, self.child_params(i)) for i, cid in enumerate(self.child_ids)]

    def update(self, out: RequestOutput) -> None:
        """Take in one child's output (its one completion gets the child's index)."""
        completion = out.outputs[0]
        completion.index = self._index[out.request_id]
        self.completions[completion.index] = completion
        if out.finished:
            self.unfinished.discard(out.request_id)
        self._num_cached_tokens = max(self._num_cached_tokens, out.num_cached_tokens)
        if self._prompt_logprobs is None:
            self._prompt_logprobs = out.prompt_logprobs
        if self._last is None or completion.index == 0:
            self._last = out

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def make_output(self) -> RequestOutput:
        """The parent's output now: all n completions in index order. ``metrics`` are
        child 0's (every child has its own, in the trace); ``num_cached_tokens`` is the
        most any child found cached (0 for the child that computed the prompt)."""
        base = self._last
        return RequestOutput(
            request_id=self.request_id,
            prompt=base.prompt,
            prompt_token_ids=base.prompt_token_ids,
            outputs=list(self.completions),
            finished=self.finished,
            metrics=base.metrics,
            num_cached_tokens=self._num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs,
        )


class ParentRequests:
    """The parents of one engine (or front end): fan-out bookkeeping and gathering."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.parent_of: dict[str, ParentRequest] = {}
        """Child id -> its parent."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for cid in parent.child_ids:
            self.parent_of[cid] = parent

    def remove(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.parent_of.pop(cid, None)

    def expand(self, request_ids: list[str]) -> list[str]:
        """Request ids with each parent id replaced by its unfinished children's ids."""
        out: list[str] = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            out.extend([c for c in parent.child_ids if c in parent.unfinished]
                       if parent is not None else [rid])
        return out

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One step's outputs with every child's replaced by one output of its parent
        (where its first child's was). A parent is forgotten once all children finished."""
        if not self.parent_of:
            return outputs
        result: list[RequestOutput | ParentRequest] = []
        seen: set[str] = set()
        for out in outputs:
            parent = self.parent_of.get(out.request_id)
            if parent is None:
                result.append(out)
                continue
            parent.update(out)
            if parent.request_id not in seen:
                seen.add(parent.request_id)
                result.append(parent)
        gathered = []
        for item in result:
            if isinstance(item, ParentRequest):
                gathered.append(item.make_output())
                if item.finished:
                    self.remove(item)
            else:
                gathered.append(item)
        return gathered
