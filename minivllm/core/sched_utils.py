"""What the scheduler checks after a step: when a request stops, loads that failed, and
background loads that arrived.

Stop *strings* are not here: they are text, and text is the front end's
(``minivllm.engine.output_processor``). The engine core stops on tokens: the end of
sequence, ``stop_token_ids``, ``max_tokens``, the model's length, and a finished grammar.

In vLLM: ``vllm/v1/core/sched/utils.py`` (``check_stop``), and the scheduler's handling of
a KV connector's ``invalid_block_ids``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import Scheduler, SchedulerOutput


def recompute_failed_loads(scheduler_output: SchedulerOutput, kv: KVCacheManager,
                           invalid_block_ids: set[int]) -> set[str]:
    """Blocks the KV connector could not load hold garbage, and every request whose
    table holds one (the one that loaded it, and any that hit it in the prefix cache the
    same step) ran on it. Each such request keeps none of this step's tokens and computes
    again from its first bad block, whose hash is forgotten so nobody hits it (vLLM's
    ``kv_load_failure_policy="recompute"``). Returns their ids."""
    failed = set()
    for s in scheduler_output.scheduled:
        table = kv.get_block_ids(s.request.request_id)
        bad = next((i for i, b in enumerate(table) if b in invalid_block_ids), None)
        if bad is not None:
            first = bad * kv.block_size
            s.request.num_computed_tokens = min(s.request.num_computed_tokens, first)
            s.request.spec_token_ids = []
            kv.uncache_blocks(s.request, first)
            failed.add(s.request.request_id)
    return failed


def finish_remote_loads(scheduler: Scheduler, finished_recving: set[str], invalid_block_ids: set[int]) -> None:
    """The KV connector's background loads that arrived (``finished_recving``): the loaded
    blocks, up to the first one whose load failed (computed from there), are registered
    in the prefix cache, and each request goes back to the front of the waiting queue,
    still ``WAITING_FOR_REMOTE_KVS``, to be admitted with its blocks in place (it needs no
    more): ``Scheduler.find_computed_tokens`` then gives its hits and loaded tokens, so the
    step that admits it records both."""
    kv = scheduler.kv_cache_manager
    for rid in finished_recving:
        request = scheduler.waiting_for_remote_kvs.pop(rid, None)
        if request is None:  # finished while loading (aborted)
            continue
        num_hit_tokens, num_external = scheduler.remote_kv_tokens[rid]
        table = kv.get_block_ids(rid)
        bad = next((i for i, b in enumerate(table) if b in invalid_block_ids), None)
        if bad is not None:
            num_external = min(num_external, bad * kv.block_size - num_hit_tokens)
            scheduler.remote_kv_tokens[rid] = (num_hit_tokens, num_external)
        if num_hit_tokens + num_external:
            kv.cache_blocks(request, num_hit_tokens + num_external)
            scheduler.waiting.appendleft(request)  # first, whatever the policy: it holds its blocks
        else:  # nothing arrived: it starts afresh (the tier forgot what it failed to read)
            kv.free(request)
            request.status = RequestStatus.PREEMPTED if request.metrics.num_preemptions else RequestStatus.WAITING
            scheduler.requeue(request)


def advance_grammar(request: Request, token: int) -> RequestStatus | None:
    """Structured output: move the request's grammar matcher over its new token.
    Finished ("stop") once the grammar is complete and has accepted the end of
    sequence, whatever ``ignore_eos`` or ``min_tokens`` say: no valid token is left.
    A token the grammar refuses (the mask forbade it: only a bug gets here) finishes
    the request with an error rather than letting it leave its grammar."""
    if request.grammar is None:
        return None
    if not request.grammar.accept_token(token):
        request.error = f"the grammar does not allow the sampled token {token}"
        return RequestStatus.FINISHED_ERROR
    return RequestStatus.FINISHED_STOPPED if request.grammar.is_terminated else None


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request's last token finishes it with, or None to go on."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    n = request.num_output_tokens
    if n >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and n >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
