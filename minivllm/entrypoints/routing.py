"""Routing: which replica serves a request, when one engine is not enough (notebook 14).

Data parallelism in serving means N copies of the whole engine, each with its own KV
cache and therefore its own prefix cache. Capacity grows N times; the prefix cache does
not. A request whose prompt starts like one served a minute ago is fast only if it lands
on the replica that still holds those blocks, so the router's choice decides the
cluster's hit rate. Three policies, from blind to cache-aware:

- ``round_robin``: replica 0, 1, ..., N-1, 0, ... Even spread of *requests*, blind to
  their length and to the cache: related requests scatter, every replica recomputes
  every shared prefix.
- ``least_outstanding``: the replica with the fewest requests in flight. Even spread of
  *load* (a replica stuck on long answers gets fewer newcomers), still blind to the cache.
- ``prefix_aware``: the replica that already holds the longest prefix of this prompt.
  The router cannot look into the replicas' caches, so it keeps its own picture of
  them: the chain of full-block hashes of every prompt it sent to each replica
  (:func:`~minivllm.core.block_pool.hash_block_tokens`, the prefix cache's own hash, so
  "same hash" means "same whole prefix", and the picture matches what the replica
  caches). The longest match wins; with no match, or when the winner is already
  ``balance_threshold`` requests busier than the least loaded replica (saturated: a
  popular prefix would otherwise pull every request to one replica), it falls back to
  least outstanding. The picture is bounded (LRU, ``max_blocks_per_replica``), as the
  replica's own cache is.

A policy sees only :class:`ReplicaState` (in-flight count, health), so the same objects
route real HTTP requests (``minivllm router``) and simulated ones
(:mod:`minivllm.sim.cluster_simulator`). Replicas that are not ``healthy`` are never chosen.

In vLLM: the data-parallel front end balances by load (``--data-parallel-size``);
cache-aware routing lives in routers in front of vLLM (``vllm-project/router``, the
production stack's router, SGLang's cache-aware router, which keeps the same kind of
approximate per-replica prefix tree).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minivllm.core.block_pool import hash_block_tokens
from minivllm.exceptions import ValidationError

ROUTING_POLICIES = ("round_robin", "least_outstanding", "prefix_aware")


@dataclass
class ReplicaState:
    """What the router knows about one replica."""

    name: str
    """Its URL for the HTTP router, an index for the simulator."""
    outstanding: int = 0
    """Requests sent to it and not finished yet."""
    healthy: bool = True


def normalize_url(url: str) -> str:
    """``host:8000/v1/`` -> ``http://host:8000``: a replica's root, where /v1 and /health
    are (the name the HTTP router gives a replica)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


class NoReplicaAvailable(RuntimeError):
    """Every replica is out of rotation."""


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def prompt_token_ids(tokenizer: Any, path: str, body: Any) -> list[int]:
    """The token ids a replica will see for an HTTP request's body, as the server makes
    them (the chat template applied exactly as it applies it), for ``prefix_aware``; []
    without a tokenizer or when the body is not one the replica would accept (it will
    say why)."""
    if tokenizer is None or not isinstance(body, dict):
        return []
    # imported here: the simulator routes with this module and needs no tokenizer
    from minivllm.entrypoints.chat_utils import apply_chat_template

    try:
        if path.endswith("/chat/completions"):
            return apply_chat_template(tokenizer, body.get("messages"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one, as the server unwraps it
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except (ValidationError, ValueError, TypeError):
        pass
    return []


PREFILL_DROPS = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of",
                 "logprobs", "top_logprobs", "prompt_logprobs", "echo")
"""Fields a prefill instance's copy of a request leaves out: they shape the answer, which
the prefill instance's is not (only its stored KV is used)."""


def prefill_request(body: dict) -> dict:
    """Disaggregated prefill: the request as the prefill instance gets it, one token,
    unstreamed, one completion, everything that shapes the prompt (messages, template
    options, the prompt itself, ``cache_salt``) unchanged, so its blocks have exactly the
    hashes the decode instance will look up. vLLM's proxy examples do the same
    (``max_tokens=1``, no stream)."""
    return {**{k: v for k, v in body.items() if k not in PREFILL_DROPS}, "max_tokens": 1}


class RoutingPolicy:
    """Chooses a replica for a prompt; told when a chosen request is sent."""

    name = "base"

    def choose(self, token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        raise NotImplementedError

    @staticmethod
    def healthy(replicas: Sequence[ReplicaState]) -> list[int]:
        alive = [i for i, r in enumerate(replicas) if r.healthy]
        if not alive:
            raise NoReplicaAvailable("no healthy replica: every replica is out of rotation")
        return alive

    @staticmethod
    def least_loaded(candidates: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """Fewest in flight; ties go to the lowest index, so the choice is reproducible."""
        return min(candidates, key=lambda i: (replicas[i].outstanding, i))


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, token_ids, replicas):
        alive = set(self.healthy(replicas))
        for step in range(len(replicas)):
            i = (self.next + step) % len(replicas)
            if i in alive:
                self.next = i + 1
                return i
        raise AssertionError("unreachable: healthy() found a replica")


class LeastOutstanding(RoutingPolicy):
    name = "least_outstanding"

    def choose(self, token_ids, replicas):
        return self.least_loaded(self.healthy(replicas), replicas)


class PrefixAware(RoutingPolicy):
    """Longest cached prefix first, least outstanding when none or when saturated."""

    name = "prefix_aware"

    def __init__(self, block_size: int = 16, balance_threshold: int = 8,
                 max_blocks_per_replica: int = 100_000) -> None:
        if block_size < 1 or balance_threshold < 0 or max_blocks_per_replica < 1:
            raise ValueError("block_size and max_blocks_per_replica must be >= 1, "
                             "balance_threshold >= 0")
        self.block_size = block_size
        self.balance_threshold = balance_threshold
        self.max_blocks = max_blocks_per_replica
        self.seen: dict[str, OrderedDict[bytes, None]] = {}
        """Per replica name: the block hashes of prompts sent to it, least recent first."""
        self.fallbacks = 0
        """How many requests had a cached prefix somewhere but went to a less busy replica."""

    def matched_blocks(self, hashes: Sequence[bytes], replica: ReplicaState) -> int:
        seen = self.seen.get(replica.name, {})
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def choose(self, token_ids, replicas):
        alive = self.healthy(replicas)
        hashes = block_hashes(token_ids, self.block_size)
        least = self.least_loaded(alive, replicas)
        matches = {i: self.matched_blocks(hashes, replicas[i]) for i in alive}
        best = max(alive, key=lambda i: (matches[i], -replicas[i].outstanding, -i))
        chosen = best
        if matches[best] == 0:
            chosen = least
        elif replicas[best].outstanding - replicas[least].outstanding > self.balance_threshold:
            chosen = least
            self.fallbacks += 1
        self.remember(replicas[chosen].name, hashes)
        return chosen

    def remember(self, name: str, hashes: Sequence[bytes]) -> None:
        seen = self.seen.setdefault(name, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def forget(self, name: str) -> None:
        """A replica left (died, restarted): its cache is gone, so is our picture of it."""
        self.seen.pop(name, None)


def make_policy(name: str, block_size: int = 16, **kwargs) -> RoutingPolicy:
    """A policy by its name in :data:`ROUTING_POLICIES`."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "prefix_aware":
        return PrefixAware(block_size=block_size, **kwargs)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}")
