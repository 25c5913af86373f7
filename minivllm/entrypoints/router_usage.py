"""What a request used, read off the replica's answer as the router relays it, so the
router can hold each tenant to its limits across all the replicas (notebook 14).

A tenant's token bucket (:mod:`minivllm.entrypoints.openai.tenants`) is charged, when a
request ends, the prompt and generated tokens the request used. One server knows that
from its own engine. Behind the router, no replica sees all of a tenant's requests, so
each replica keeping its own bucket would let a tenant use N times its limit. The
router keeps the one bucket, and learns what each request used from the answer:

* a whole answer carries ``usage`` (OpenAI's field);
* a stream carries it only if the client asked (``stream_options``). The router asks for
  it on the client's behalf, with vLLM's ``continuous_usage_stats`` too, so every chunk
  says how many tokens its choice has so far. A stream the client closes early is then
  charged what was relayed. What the client did not ask for is taken out again before
  the chunk is relayed, so the client sees the stream it asked for.

In vLLM: ``vllm serve`` keeps no per-key limits; a gateway in front does (the production
stack's router, or an API gateway), and reads usage the same way.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.entrypoints.openai.tenants import Lease


def ask_for_usage(body: Any) -> tuple[bytes | None, bool, bool]:
    """For a streamed request's parsed ``body``: the body to forward, asking for usage in
    every chunk (None: forward the client's bytes unchanged, e.g. a bad
    ``stream_options`` the replica will refuse by name), and whether the client itself
    asked for the last usage chunk and for usage in every chunk."""
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return None, False, False
    include, continuous = options.get("include_usage"), options.get("continuous_usage_stats")
    if not all(v is None or isinstance(v, bool) for v in (include, continuous)):
        return None, False, False
    wanted_last = bool(include)
    wanted_every = wanted_last and bool(continuous)
    forced = {**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": True}}
    return json.dumps(forced).encode(), wanted_last, wanted_every


def usage_of(content: bytes) -> tuple[int, int] | None:
    """(prompt tokens, generated tokens) of a whole answer's ``usage``, or None."""
    try:
        used = json.loads(content).get("usage")
        return int(used["prompt_tokens"]), int(used["completion_tokens"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class UsageWatcher:
    """Reads the usage in a stream of server-sent events into ``lease`` (if given) and
    hands on the events with what the client did not ask for taken out. Feed it bytes as
    they arrive (:meth:`feed`); an event is handed on once it is whole (it ends with a
    blank line). With ``passthrough`` it hands every byte on at once and reads nothing."""

    def __init__(self, wanted_last: bool, wanted_every: bool, lease: Lease | None = None,
                 passthrough: bool = False) -> None:
        self.wanted_last, self.wanted_every = wanted_last, wanted_every
        self.lease, self.passthrough = lease, passthrough
        self.prompt = 0
        self.per_choice: dict[int, int] = {}
        """Each choice's generated tokens so far, from its latest chunk."""
        self.total: tuple[int, int] | None = None
        """The last chunk's usage, once it has come."""
        self._buffer = b""

    @property
    def used(self) -> tuple[int, int] | None:
        """(prompt tokens, generated tokens) so far; None before any chunk said."""
        if self.total is not None:
            return self.total
        if not self.per_choice:
            return None
        return self.prompt, sum(self.per_choice.values())

    def feed(self, data: bytes) -> bytes:
        """The whole events that ``data`` completes, to relay."""
        if self.passthrough:
            return data
        *events, self._buffer = (self._buffer + data).split(b"\n\n")
        relayed = b"".join(out + b"\n\n" for e in events if (out := self._event(e)) is not None)
        if self.lease is not None:
            self.lease.usage = self.used
        return relayed

    def rest(self) -> bytes:
        """What is left of an unfinished last event (relayed as it is)."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: {"):
            return event  # [DONE], or not a chunk
        try:
            chunk = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        used = chunk.get("usage") if isinstance(chunk, dict) else None
        if not isinstance(used, dict):
            return event  # an error event, or a chunk without usage
        choices = chunk.get("choices")
        if choices == []:  # the last chunk: the request's usage
            self.total = (used.get("prompt_tokens", 0), used.get("completion_tokens", 0))
            return event if self.wanted_last else None
        self.prompt = used.get("prompt_tokens", self.prompt)
        for choice in choices or []:
            self.per_choice[choice.get("index", 0)] = used.get("completion_tokens", 0)
        if self.wanted_every:
            return event
        del chunk["usage"]
        return b"data: " + json.dumps(chunk).encode()
