"""Tenants: who is asking, how much they may ask for, what they have used, and what
they can learn about each other.

One server often serves several users, and each holds an API key. This module turns the
keys into tenants and decides four things for each:

* **Who.** ``Authorization: Bearer KEY`` names the tenant. The key is compared with every
  tenant's key in constant time, so the time taken does not tell which key came close.
* **How much at once.** ``max_concurrent_requests`` is the most requests a tenant may have
  in flight. The next one gets ``429 Too Many Requests`` with ``Retry-After: 1``, before
  its body is read. Without such a cap, one tenant can fill every seat of the batch and
  the waiting queue, and every other tenant then waits behind it.
* **How much per minute.** ``max_tokens_per_minute`` is a token bucket. It holds at most
  that many tokens and refills at that rate. A request is admitted while the bucket
  holds at least one token. When the request ends, it is charged what it used (prompt
  plus generated tokens, the ``usage`` the client is shown). A request's size is unknown
  until it ends, so the bucket can go below zero. The tenant then gets 429s, with a
  ``Retry-After`` that says when the bucket is back at one token.
* **What leaks between tenants.** The prefix cache is shared, so a cache hit makes the
  first token come sooner. By timing its own first token, a tenant could tell that
  another tenant recently sent the same prompt (a system prompt, a document). With
  ``cache_salt_per_key``, every request carries its tenant's salt, mixed with the
  request's own ``cache_salt`` if it has one. Tenants then never share a cached block,
  and the timing shows nothing.

Usage per tenant (requests, prompt and generated tokens, refusals by reason, requests
in flight) goes to ``/metrics``. Metrics are labelled with the tenant's *name*, never
with its key.

In vLLM (0.34): ``vllm serve --api-key`` takes one or more keys, all with the same
rights. Per-key limits, per-key usage and salting by key are left to a gateway in front
(vLLM's production stack); a request can still send ``cache_salt`` itself. Here the
three live in the server, in one module a reader can hold in their head.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.exceptions import ValidationError
from minivllm.metrics import Counter, Gauge

if TYPE_CHECKING:
    from minivllm.engine.async_llm import RequestStream

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FIELDS = {"name", "api_key", "max_concurrent_requests", "max_tokens_per_minute"}


@dataclass
class Tenant:
    """One API key's owner: its limits (None: no limit) and what it has used."""

    name: str
    api_key: str
    max_concurrent_requests: int | None = None
    max_tokens_per_minute: int | None = None
    running: int = 0
    """Requests admitted and not yet ended."""
    bucket: float = 0.0
    """Tokens it may still use; refilled by ``max_tokens_per_minute / 60`` each second."""
    refilled_at: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """Requests refused with 429, by reason: "concurrency" or "token_rate"."""


class RateLimited(Exception):
    """A tenant is over one of its limits: answer 429 with ``Retry-After``."""

    def __init__(self, message: str, reason: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason, self.retry_after = reason, retry_after


class Lease:
    """One admitted request's seat. The server sets ``stream`` once the request is
    queued (the router sets ``usage`` instead). The seat is released when the response
    ends, however it ends (finished, failed, or the client gone), and the tenant is then
    charged what the request used."""

    def __init__(self, tenants: Tenants, tenant: Tenant) -> None:
        self.tenants, self.tenant = tenants, tenant
        self.stream: RequestStream | None = None
        self.usage: tuple[int, int] | None = None
        """(prompt, generated) tokens, set where there is no stream to read them from:
        the router reads them off the replica's answer (``router_usage``)."""
        self.released = False

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt the request runs with: its own, or with salting by key, the tenant's
        name mixed with its own (so no two tenants share a salt)."""
        if not self.tenants.cache_salt_per_key:
            return requested
        return f"tenant:{self.tenant.name}" + ("" if requested is None else f"/{requested}")

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        tenant = self.tenant
        tenant.running -= 1
        last = self.stream.last if self.stream is not None else None
        if last is not None:
            self.usage = len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs)
        if self.usage is not None:
            prompt, generated = self.usage
            tenant.prompt_tokens += prompt
            tenant.generation_tokens += generated
            if tenant.max_tokens_per_minute is not None:
                self.tenants.refill(tenant)
                tenant.bucket -= prompt + generated


class Tenants:
    """The server's tenants, looked up by key, with their limits kept on one clock."""

    def __init__(self, tenants: Sequence[Tenant], cache_salt_per_key: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_tenants(tenants)
        self.tenants = list(tenants)
        self.cache_salt_per_key = cache_salt_per_key
        self.clock = clock
        now = clock()
        for t in self.tenants:
            t.bucket, t.refilled_at = float(t.max_tokens_per_minute or 0), now
        self._keys = [(t.api_key.encode(), t) for t in self.tenants]

    @classmethod
    def from_options(cls, api_keys: str | Sequence[str] | None = None, tenants_file: str | None = None,
                     cache_salt_per_key: bool = False) -> Tenants | None:
        """The tenants of ``--api-key`` (each key a tenant without limits, named
        ``key0``, ``key1``, ... in order) and of ``--tenants FILE``. Returns None when no
        key is given (an open server), and refuses salting by key then: there would be
        no key to salt by."""
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or [])
        tenants = [Tenant(f"key{i}", k) for i, k in enumerate(keys)]
        if tenants_file is not None:
            tenants += load_tenants(tenants_file)
        if not tenants:
            if cache_salt_per_key:
                raise ValidationError("cache_salt_per_key", "cache_salt_per_key needs API keys "
                                      "(--api-key or --tenants): there is no key to salt by", True)
            return None
        return cls(tenants, cache_salt_per_key)

    def authenticate(self, token: bytes) -> Tenant | None:
        """The tenant whose key is ``token``, or None. Every key is compared (as bytes, in
        constant time), so the answer takes as long whichever key matched."""
        found = None
        for key, tenant in self._keys:
            if secrets.compare_digest(token, key):
                found = tenant
        return found

    def refill(self, tenant: Tenant) -> None:
        now = self.clock()
        rate = tenant.max_tokens_per_minute / 60.0
        tenant.bucket = min(float(tenant.max_tokens_per_minute),
                            tenant.bucket + (now - tenant.refilled_at) * rate)
        tenant.refilled_at = now

    def admit(self, tenant: Tenant) -> Lease:
        """A seat for one more request of ``tenant``, or :class:`RateLimited`."""
        limit = tenant.max_concurrent_requests
        if limit is not None and tenant.running >= limit:
            tenant.rejected["concurrency"] = tenant.rejected.get("concurrency", 0) + 1
            raise RateLimited(f"tenant {tenant.name!r} has {tenant.running} requests in flight, its "
                              f"limit (max_concurrent_requests={limit}); retry when one has "
                              f"finished", "concurrency", 1)
        if tenant.max_tokens_per_minute is not None:
            self.refill(tenant)
            if tenant.bucket < 1:
                rate = tenant.max_tokens_per_minute / 60.0
                wait = max(1, math.ceil((1 - tenant.bucket) / rate))
                tenant.rejected["token_rate"] = tenant.rejected.get("token_rate", 0) + 1
                raise RateLimited(f"tenant {tenant.name!r} has used its tokens for now "
                                  f"(max_tokens_per_minute={tenant.max_tokens_per_minute}); "
                                  f"retry in {wait} s", "token_rate", wait)
        tenant.running += 1
        tenant.requests += 1
        return Lease(self, tenant)

    def records(self, prefix: str = "minivllm:tenant_") -> list[Counter | Gauge]:
        """Usage per tenant, as ``/metrics`` records (labelled by name, never by key).
        The router names its own ``minivllm:router_tenant_*``: its replicas' are re-exported
        beside them."""
        out: list[Counter | Gauge] = []
        for t in self.tenants:
            lab = {"tenant": t.name}
            out += [Counter(prefix + "requests", t.requests, lab),
                    Counter(prefix + "prompt_tokens", t.prompt_tokens, lab),
                    Counter(prefix + "generation_tokens", t.generation_tokens, lab),
                    Gauge(prefix + "requests_running", t.running, lab)]
            out += [Counter(prefix + "rate_limited_requests", t.rejected.get(r, 0),
                            {**lab, "reason": r}) for r in ("concurrency", "token_rate")]
        return out


def load_tenants(path: str) -> list[Tenant]:
    """The tenants of a JSON file::

        {"tenants": [{"name": "alice", "api_key": "sk-alice-...",
                      "max_concurrent_requests": 4, "max_tokens_per_minute": 20000},
                     {"name": "bob", "api_key": "sk-bob-..."}]}

    Every refusal names the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValidationError("tenants", f"cannot read the tenants file {path!r}: {e}", path) from None
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], list):
        raise ValidationError("tenants", f"{path}: the file must hold {{\"tenants\": [...]}}", path)
    tenants = []
    for i, entry in enumerate(data["tenants"]):
        where = f"{path}: tenants[{i}]"
        if not isinstance(entry, dict) or not {"name", "api_key"} <= set(entry) or set(entry) - _FIELDS:
            raise ValidationError("tenants", f"{where} must be an object with 'name' and 'api_key' "
                                  f"and optionally 'max_concurrent_requests' and "
                                  f"'max_tokens_per_minute'; got {entry!r:.200}", path)
        tenants.append(Tenant(**entry))
    return tenants


def check_tenants(tenants: Sequence[Tenant]) -> None:
    """Names a metric label can carry, keys that are non-empty and unique, limits that
    are positive integers."""
    names: set[str] = set()
    keys: set[str] = set()
    for t in tenants:
        if not isinstance(t.name, str) or not _NAME.match(t.name) or t.name in names:
            raise ValidationError("tenants", f"tenant name {t.name!r} must be unique and 1-64 "
                                  f"letters, digits, '_', '.' or '-'", t.name)
        if not isinstance(t.api_key, str) or not t.api_key or t.api_key in keys:
            raise ValidationError("tenants", f"tenant {t.name!r}: its api_key must be a non-empty "
                                  f"string that no other tenant has", t.name)
        for limit in ("max_concurrent_requests", "max_tokens_per_minute"):
            value = getattr(t, limit)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValidationError("tenants", f"tenant {t.name!r}: {limit} must be a positive "
                                      f"integer or absent, got {value!r}", value)
        names.add(t.name)
        keys.add(t.api_key)
