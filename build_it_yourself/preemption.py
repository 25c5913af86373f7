"""Build it yourself, piece 4: preemption (choosing the victim, and recompute).

Read first: notebook 08 (preemption).
Check:      minivllm check preemption build_it_yourself/preemption.py:MyScheduler
Solution:   minivllm/core/scheduler.py (the engine's Scheduler.preempt_victim)

When the KV cache cannot hold a running request's next tokens, the scheduler's loop
(``Scheduler.schedule``, the engine's own here) calls ``preempt_victim()`` until the
allocation succeeds. vLLM V1 preempts by *recompute*: the victim loses its KV blocks and
later runs its prompt and everything it generated again, as one prefill. Its output is
unchanged (greedy, or seeded: its random generator is kept); only time is lost.
"""

from __future__ import annotations

from minivllm.core.scheduler import Scheduler
from minivllm.request import Request, RequestStatus  # noqa: F401  (RequestStatus: for you)


class MyScheduler(Scheduler):
    def preempt_victim(self) -> Request:
        """Preempt one running request and return it.

        - The victim is the most recently admitted running request (the last of
          ``self.running``): it has waited least and has the least work to lose. Take
          it out of ``self.running``.
        - Free its blocks: ``self.kv_cache_manager.free(victim)``.
        - Recompute: ``status = RequestStatus.PREEMPTED``, ``num_computed_tokens = 0``;
          keep its output tokens (they are recomputed with the prompt).
        - Count it: ``victim.metrics.num_preemptions`` and ``self.num_preemptions``, one
          more each.
        - It goes back to the *front* of ``self.waiting``, ahead of requests that never
          ran (``appendleft``).
        """
        raise NotImplementedError("MyScheduler.preempt_victim: free the most recently "
                                  "admitted running request, queue it for recompute "
                                  "(see its docstring)")
