"""Build it yourself, piece 3: the scheduler's token-budget loop with chunked prefill.

Read first: notebook 04 (continuous batching), notebook 06 (chunked prefill).
Check:      minivllm check scheduler build_it_yourself/scheduler.py:MyScheduler
Solution:   minivllm/core/scheduler.py (the engine's Scheduler.schedule)

Once per engine step, ``schedule()`` decides which requests run and how many tokens each
computes. A request is described by counts, not phases: ``request.num_computed_tokens``
chases ``request.num_tokens`` (prompt plus generated tokens). A prompt, a prompt chunk, a
decode (1 token) and a preempted request's recompute are all the same thing: "compute
the next ``num_tokens - num_computed_tokens`` tokens, or as many as the budget allows".

What you have (``self``): ``running`` (a list, oldest admission first), ``waiting`` (a
deque, first come first served), ``kv_cache_manager`` (``get_computed_blocks(request)``
-> ``(hit_blocks, num_hit_tokens)``; ``allocate_slots(request, n, hit_blocks=None)`` ->
None when memory is short), ``max_num_batched_tokens`` (the budget), ``max_num_seqs``,
``enable_chunked_prefill``, and ``preempt_victim()`` (piece 4: frees the most recently
admitted running request, puts it at the front of ``waiting`` and returns it).
"""

from __future__ import annotations

from minivllm.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput  # noqa: F401
from minivllm.request import RequestStatus  # noqa: F401  (for you: RUNNING, PREEMPTED)


class MyScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        """One step's plan: ``SchedulerOutput(scheduled=[ScheduledRequest.make(request, n),
        ...], preempted=[request ids], prefix_cache_hits={request id: hit tokens})``.

        1. ``budget = self.max_num_batched_tokens``: every scheduled token counts,
           prompt or decode.
        2. Running requests first, in order, while budget is left: each asks for
           ``min(num_tokens - num_computed_tokens, budget)`` tokens (with chunked prefill
           a long prompt takes what is left: the rest comes next step).
           If ``allocate_slots`` returns None, preempt (``self.preempt_victim()``), note
           the victim's id in ``preempted``, and try again; if the victim was the request
           itself, stop scheduling running requests.
        3. Then waiting requests (``self.waiting[0]`` first), unless something was
           preempted this step, while budget is left and fewer than ``max_num_seqs`` run:
           take its prefix-cache hits (``get_computed_blocks``), ask for the tokens
           after them (cut to the budget; without chunked prefill a prompt that does not
           fit whole waits, except a preempted request that has grown past the whole
           budget), ``allocate_slots(request, n, hits)``; None means stop admitting.
           Admitted: pop it from ``waiting``, ``num_computed_tokens = num_hit_tokens``,
           status RUNNING, append to ``running``, record its hits in
           ``prefix_cache_hits`` (and, if never preempted, in
           ``request.metrics.num_cached_tokens``).
        4. Make each ``ScheduledRequest`` *before* moving the counts (``make`` reads
           ``num_computed_tokens`` to tell a prefill from a decode); at the end add each
           scheduled ``num_new_tokens`` to its request's ``num_computed_tokens`` (the
           model runner writes their K/V this step).

        The budget is never exceeded, every request that runs has the blocks for its
        tokens, and a prompt longer than the budget still finishes (chunk by chunk).
        """
        raise NotImplementedError("MyScheduler.schedule: running requests first, then "
                                  "waiting ones, within the token budget (see its docstring)")
