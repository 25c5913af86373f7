"""Scheduler: decides which requests run this step and how many tokens each gets.

vLLM V1's policy, in about a hundred lines (notebooks 04, 06, 08):

1. One *token budget* per step (``max_num_batched_tokens``) bounds the work of a forward
   pass. Every scheduled token counts, whether it is a prompt token or a decode.
2. Running requests go first, in admission order, each asking for
   ``num_tokens - num_computed_tokens`` tokens: 1 for a decode, the rest of the prompt
   for a request still prefilling. With chunked prefill a request takes what is left of
   the budget, so a long prompt is cut into chunks that share steps with decodes.
3. If the KV cache cannot hold a running request's new tokens, the most recently
   admitted running request is *preempted*: its blocks are freed, it goes back to the
   front of the waiting queue with ``num_computed_tokens = 0``, and later recomputes its
   prompt plus everything it had generated. Its output is unchanged; only time is lost.
4. Then waiting requests are admitted first come, first served, while budget, KV blocks
   and ``max_num_seqs`` allow. Prefix-cache hits are adopted here, and with a KV
   connector (``minivllm.distributed.kv_transfer``) the blocks it can load after them.
   A load the connector makes asynchronous (from disk, or from another engine) does not
   hold the step: the request gets its blocks and waits aside in
   ``WAITING_FOR_REMOTE_KVS`` while the others run, and is admitted again, its loaded
   tokens counted as computed, in the step after the connector reports them arrived.

The scheduler never touches tensors; the model runner never makes policy.

Scheduling policy (``scheduling_policy``, vLLM's ``--scheduling-policy``). A server
rarely sees one kind of traffic. A person typing in a chat window waits for the first
token; a batch job (an overnight evaluation, embedding a document store) waits only for
the last one, hours away. Under ``"fcfs"`` they queue together, so one batch job of a
thousand long prompts puts every chat request behind a thousand prefills. Under
``"priority"`` each request carries an integer ``priority`` (lower runs first; vLLM's
convention) and the policy changes exactly two decisions, both in this file:

* *Who is admitted next*: the waiting queue is kept ordered by (priority, arrival), so
  an interactive request (priority 0, say) is admitted ahead of every batch request
  (priority 1) that arrived before it. Among equals it is first come, first served, so
  nobody of equal priority overtakes anybody (no starvation among equals).
* *Who is preempted when memory runs out*: the least important running request (largest
  priority value, latest arrival among equals; vLLM V1's rule) instead of the most
  recently admitted one. The request needing room is a candidate too, so a request is
  never evicted for one less important than itself: if everyone else matters more, the
  request that needs room preempts itself and waits.

What priority does not do: it never evicts a running request to admit a waiting one
(neither does vLLM), so an interactive request still waits for a free seat
(``max_num_seqs``) or free blocks. And preemption has a price: the victim's KV is thrown
away and its prompt plus everything it generated is prefilled again later, so each
preemption of a long batch request costs a long prefill (``minivllm bench priority``
measures what the interactive requests gain and what the batch job pays).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.config import SCHEDULING_POLICIES
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sched_utils import (
    advance_grammar,
    check_stop,
    finish_remote_loads,
    recompute_failed_loads,
)
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
    from minivllm.worker.model_runner import ModelRunnerOutput


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    """Tokens already in the cache before this step (the new ones start here)."""
    is_prefill: bool = False
    """True for a prompt (chunk) or a resumed request's recompute; False for a decode,
    which computes exactly the one token sampled last step."""
    samples: bool = False
    """Whether this step ends with a new token: only once every known token is computed."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens scored after the request's last token (speculative decoding); they are
    the last ``len(spec_token_ids)`` of ``num_new_tokens``."""

    @classmethod
    def make(cls, request: Request, num_new_tokens: int,
             spec_token_ids: list[int] | None = None) -> ScheduledRequest:
        done = request.num_computed_tokens
        spec = spec_token_ids or []
        num_known = num_new_tokens - len(spec)
        # With async scheduling the last token may still be being sampled (a placeholder).
        num_tokens = request.num_tokens + request.num_output_placeholders
        decode = (
            num_known == 1
            and done == num_tokens - 1
            and done >= request.num_prompt_tokens
        )
        return cls(
            request, num_new_tokens, done,
            is_prefill=not decode,
            samples=done + num_known == num_tokens,
            spec_token_ids=spec,
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    prefix_cache_hits: dict[str, int] = field(default_factory=dict)
    """Tokens taken from the prefix cache by each request admitted this step."""
    external_cache_hits: dict[str, int] = field(default_factory=dict)
    """Tokens the KV connector loads for each request admitted this step (after its hits)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's transfers for this step, for the worker side (None: no connector)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        kv_connector: KVConnectorBase_V1 | None = None,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.kv_connector = kv_connector
        self.waiting: deque[Request] = deque()
        """First in line at the left. Under "priority", ordered by :meth:`priority_key`."""
        self.running: list[Request] = []
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        """Requests whose blocks a KV connector is loading in the background."""
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrival_order: dict[str, int] = {}
        self.remote_kv_tokens: dict[str, tuple[int, int]] = {}
        """Request id -> (its prefix-cache hits, the tokens a background load brings), from
        the step it starts waiting for them to the end of the request."""
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._counter)
        if self.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def priority_key(self, request: Request) -> tuple[int, float, int]:
        """Smaller runs first: priority, then arrival time, then the order requests were
        added (so equal priorities and equal arrival times stay first come, first served)."""
        return (request.priority, request.metrics.arrival_time,
                self._arrival_order[request.request_id])

    def _insert_by_priority(self, request: Request) -> None:
        """Keep ``waiting`` sorted by :meth:`priority_key` (a plain sorted deque: a heap
        would be faster for long queues, but a reader can print this one in order)."""
        keys = [self.priority_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self.priority_key(request), lo=self._num_arrived()), request)

    def _num_arrived(self) -> int:
        """How many requests at the front of ``waiting`` hold the KV a background load
        brought (:func:`~minivllm.core.sched_utils.finish_remote_loads`). They stay first
        under every policy: they hold all their blocks, so admitting them always makes
        progress."""
        return next((i for i, r in enumerate(self.waiting)
                     if r.status is not RequestStatus.WAITING_FOR_REMOTE_KVS), len(self.waiting))

    def requeue(self, request: Request) -> None:
        """Put a request that had been admitted back in line: at the front under "fcfs"
        (it has waited longest; only requests whose KV has arrived stay ahead of it), at
        its place by priority under "priority" (where an earlier arrival of the same
        priority puts it ahead of those that never ran)."""
        if self.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.insert(self._num_arrived(), request)

    def schedule(self) -> SchedulerOutput:
        """One step's batch: running requests first, then waiting ones, in one token budget
        (``max_num_batched_tokens``). Each loop returns the budget it left."""
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # no admissions in a step where memory just ran out
            self.schedule_waiting(out, budget)
        # The tokens are as good as computed: the runner writes their K/V this step.
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        if self.kv_connector is not None and out.scheduled:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests, oldest admission first; preempts when the KV cache is full."""
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.must_wait(request):
                i += 1
                continue
            # Drafts (speculative decoding) are tokens to compute like any other: they
            # count in the budget and get KV slots; the budget may cut them short.
            num_known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            spec = request.spec_token_ids[:max(num_new - num_known, 0)]
            while kv.allocate_slots(request, num_new) is None:
                victim = self.preempt_victim()
                out.preempted.append(victim.request_id)
                if victim is request:  # it left self.running: index i is the next request now
                    break
                # Under "priority" the victim may have run earlier in this loop (a
                # decode scheduled this very step): take its tokens back, and step the
                # index back over it so that no request is skipped.
                done = next((s for s in out.scheduled if s.request is victim), None)
                if done is not None:
                    out.scheduled.remove(done)
                    budget += done.num_new_tokens
                    i -= 1
            else:
                out.scheduled.append(ScheduledRequest.make(request, num_new, spec))
                request.spec_token_ids = []  # proposed afresh after this step
                budget -= num_new
                i += 1
        return budget

    def must_wait(self, request: Request) -> bool:
        """Whether a running request sits this step out. Never here: the engine processes
        each step's tokens before it schedules the next. (With async scheduling a
        request may still be in flight: ``minivllm.core.async_scheduler``.)"""
        return False

    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting requests, first in line first, while budget, KV blocks and seats last."""
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens, num_external, load_async = self.find_computed_tokens(request)
            if load_async:  # the connector loads them in the background: the request waits aside
                if not self.wait_for_remote_kvs(out, request, hits, num_hit_tokens, num_external):
                    break
                continue
            num_new = request.num_tokens - num_hit_tokens - num_external
            if num_new > budget and not self.enable_chunked_prefill:
                # Without chunking a prompt runs whole (add_request keeps prompts within the
                # budget). A preempted request may have grown past the whole budget while it
                # ran, though: it is recomputed in chunks, or it could never run again.
                resumed = request.status is RequestStatus.PREEMPTED
                if not (resumed and num_new > self.max_num_batched_tokens):
                    break
            num_new = min(num_new, budget)
            if kv.allocate_slots(request, num_external + num_new, hits) is None:
                break
            self.waiting.popleft()
            if self.kv_connector is not None:  # the blocks to load into are allocated now
                self.kv_connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), num_external)
                out.external_cache_hits[request.request_id] = num_external
            request.num_computed_tokens = num_hit_tokens + num_external
            out.scheduled.append(ScheduledRequest.make(request, num_new))
            if request.metrics.num_preemptions == 0:
                request.metrics.num_cached_tokens = num_hit_tokens + num_external
            out.prefix_cache_hits[request.request_id] = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= num_new
        return budget

    def find_computed_tokens(self, request: Request) -> tuple[list, int, int, bool]:
        """What of a waiting request is computed already: its prefix-cache hits (blocks,
        tokens), the tokens after them that the KV connector can load
        (``minivllm.distributed.kv_transfer``; 0 without one), and whether it loads them
        in the background. A request whose background load has arrived holds its blocks
        already: the same counts, with nothing left to adopt or to load."""
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:  # back from sched_utils.finish_remote_loads
            return [], *self.remote_kv_tokens[request.request_id], False
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self.kv_connector is None:
            return hits, num_hit_tokens, 0, False
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
        return hits, num_hit_tokens, num_external, load_async and num_external > 0

    def wait_for_remote_kvs(self, out: SchedulerOutput, request: Request, hits: list, num_hit_tokens: int,
                            num_external: int) -> bool:
        """Admit the first waiting request for a background load: its hits and blocks for
        its whole prompt are allocated (those to load into kept out of the prefix cache
        until they are filled), and it waits aside, in no step. False if the blocks are
        not there. (All its blocks now: a request whose KV has arrived must never wait
        for blocks that requests in the same state hold.)"""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, delay_cache_blocks=True) is None:
            return False
        self.waiting.remove(request)
        self.kv_connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self.remote_kv_tokens[request.request_id] = (num_hit_tokens, num_external)
        return True

    def preempt_victim(self) -> Request:
        """Memory ran out (a running request could not get its blocks): preempt one
        running request and return it.

        Under "fcfs", the most recently admitted running request: the one that has
        waited least, and whose eviction loses least work. Under "priority", the least
        important one by :meth:`priority_key` (largest priority value, latest arrival).
        The request that needs room is running too, so it is among the candidates: the
        victim is never more important than it, and when everyone else is, the victim is
        that request itself (vLLM V1: ``max(running, key=(priority, arrival_time))``).

        Preemption by *recompute*: its blocks are freed, it goes back to the waiting
        queue (front, or its place by priority) with ``num_computed_tokens = 0`` and
        keeps its output tokens, so when it is admitted again its prompt and those tokens
        run as one prefill. The cost is that prefill, paid again.
        """
        if self.policy == "priority":
            request = max(self.running, key=self.priority_key)
            self.running.remove(request)
        else:
            request = self.running.pop()
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.requeue(request)
        return request

    def rollback(self, scheduler_output: SchedulerOutput) -> None:
        """Undo a step whose forward pass failed, so the engine can carry on as if it had
        not been scheduled (it may be scheduled again at once).

        ``schedule()`` counted every scheduled token as computed and registered the blocks
        they fill in the prefix cache; neither holds now. So each scheduled request gets
        its ``num_computed_tokens`` back, the hashes of blocks this step was to fill are
        forgotten (nobody may hit K/V that was never written), and requests admitted in
        this step go back to the front of the waiting queue with their blocks freed (they
        may have adopted a block that this very step was to fill). Preemptions stand:
        a preempted request is consistent on its own, and will be recomputed.
        """
        kv = self.kv_cache_manager
        hits = scheduler_output.prefix_cache_hits
        admitted = [s for s in scheduler_output.scheduled if s.request.request_id in hits]
        for s in scheduler_output.scheduled:
            # An admitted request's blocks after its own hits were to be loaded or computed.
            kv.uncache_blocks(s.request, hits.get(s.request.request_id, s.num_computed_tokens))
            s.request.num_computed_tokens = s.num_computed_tokens
            s.request.spec_token_ids = list(s.spec_token_ids)
        for s in reversed(admitted):  # appendleft in reverse keeps their order
            request = s.request
            self.running.remove(request)
            kv.free(request)
            request.num_computed_tokens = 0
            resumed = request.metrics.num_preemptions > 0
            request.status = RequestStatus.PREEMPTED if resumed else RequestStatus.WAITING
            self.requeue(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Append each sampled token, apply token-level stop rules, free the finished.

        A request whose sampling failed (in ``model_runner_output.errors``) is finished
        with status FINISHED_ERROR; the others are not affected. Returns the requests
        that received tokens or an error this step (finished or not).

        With speculative decoding a request may get several tokens: its accepted drafts,
        then the target's token. They are appended one by one with the stop rules
        checked after each, so nothing past a stop is ever kept; the KV of the rejected
        drafts is given up by rolling ``num_computed_tokens`` back over them.
        """
        updated, failed = [], set()
        connector_output = model_runner_output.kv_connector_output
        if self.kv_connector is not None:
            self.kv_connector.update_connector_output(connector_output)
            finish_remote_loads(self, connector_output.finished_recving, connector_output.invalid_block_ids)
            failed = recompute_failed_loads(scheduler_output, self.kv_cache_manager,
                                            connector_output.invalid_block_ids)
        for s in scheduler_output.scheduled:
            request = s.request
            rid = request.request_id
            if request.is_finished or rid in failed or (rid not in model_runner_output.sampled
                                                        and rid not in model_runner_output.errors):
                continue
            if rid in model_runner_output.errors:
                request.error = model_runner_output.errors[rid]
                self.finish_request(request, RequestStatus.FINISHED_ERROR)
                updated.append(request)
                continue
            tokens = model_runner_output.sampled[rid]
            if s.spec_token_ids:
                num_rejected = len(s.spec_token_ids) - (len(tokens) - 1)
                self.rollback_rejected(request, num_rejected)
            for t in tokens:
                request.append_output_token(t)
                status = advance_grammar(request, t) or check_stop(request, self.max_model_len)
                if status is not None:
                    self.finish_request(request, status)
                    break
            updated.append(request)
        return updated

    def rollback_rejected(self, request: Request, num_rejected: int) -> None:
        """Forget the KV of ``num_rejected`` rejected drafts: they were counted as
        computed when scheduled. Their slots hold stale K/V that no one reads (attention
        stops at ``num_computed_tokens``) and that the next step overwrites; blocks that
        now hold no computed token at all go back to the pool. (None of them is in the
        prefix cache: only blocks full of known tokens are, and drafts are not known.)"""
        request.num_computed_tokens -= num_rejected
        self.kv_cache_manager.free_tail_blocks(request, request.num_computed_tokens)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request wherever it is, and free its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.waiting_for_remote_kvs.pop(request.request_id, None)
        self.remote_kv_tokens.pop(request.request_id, None)
        request.status = status
        if self.kv_connector is not None:  # waits for a load into its blocks still under way
            self.kv_connector.request_finished(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._arrival_order.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote_kvs)
