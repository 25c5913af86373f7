"""Workloads: seeded lists of requests that every benchmark and simulation replays.

A benchmark is only a comparison if every tool serves the *same* requests. So a workload
is plain data: token ids, how many tokens to generate, and when each request arrives.
The text comes from Python's own docstrings (the standard library documents itself), so
nothing is downloaded and the same seed gives the same token ids on any machine with the
same Python and tokenizer. Notebooks 02 (why batching) and 09 (benchmarks) use it.

    from minivllm.sim.workload import chat_workload
    requests = chat_workload(llm.get_tokenizer(), n=32, seed=0)   # the standard workload
    requests[0].prompt_token_ids, requests[0].max_tokens, requests[0].arrival_time

Lengths are drawn per request from a range (uniform, or log-normal clipped to the range,
which gives the long tail real chat traffic has). Arrivals are all at time 0 (offline
batch) or a Poisson process at ``rate`` requests per second (online serving). An optional
shared prefix (a system prompt of N tokens, identical in every request) is what prefix
caching feeds on.
"""

from __future__ import annotations

import importlib
import inspect
import math
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from minivllm.sampling_params import SamplingParams

# Modules whose documentation is the corpus: stable, long, and always installed.
CORPUS_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmd",
    "collections", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "doctest", "enum", "fractions", "functools", "gzip", "hashlib", "heapq",
    "html", "http.client", "imaplib", "inspect", "io", "itertools", "json", "logging",
    "math", "mailbox", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "sched", "secrets", "shelve", "shlex", "shutil", "smtplib", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile", "builtins",
)
INSTRUCTIONS = (
    "Summarize the following documentation in plain words.",
    "Explain what this is for, as if to a new programmer.",
    "List the key points of this text.",
    "Write two questions a student might ask after reading this.",
    "Rewrite this more concisely.",
    "What are the pitfalls a user should know about, according to this text?",
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
_SYS, _USER = "\x00SYSTEM\x00", "\x00USER\x00"


@dataclass
class WorkloadRequest:
    """One request of a workload: what every tool in a benchmark is given."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    """Exactly this many tokens are generated (greedy, ``ignore_eos``)."""
    arrival_time: float = 0.0
    """Seconds after the start of the run."""
    prompt: str | None = None
    """The user message, for display (None for token-only workloads)."""
    priority: int = 0
    """Lower runs first, on an engine with ``scheduling_policy="priority"``."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)


@lru_cache(maxsize=1)
def corpus_documents() -> tuple[str, ...]:
    """Docstrings of the modules above and of their public members, in a fixed order."""
    docs: list[str] = []
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # e.g. sqlite3 missing from a minimal Python build
            continue
        with warnings.catch_warnings():  # e.g. typing.io warns that it is deprecated
            warnings.simplefilter("ignore")
            objects = [module] + [getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_")]
            for obj in objects:
                doc = inspect.getdoc(obj) if obj is not None else None
                if doc and len(doc) >= 200 and doc not in docs[-50:]:
                    docs.append(doc)
    return tuple(docs)


@lru_cache(maxsize=4)
def _corpus_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokenizer.encode(d + "\n\n", add_special_tokens=False)) for d in corpus_documents())


def _draw_length(rng: random.Random, spec: int | tuple[int, int], dist: str) -> int:
    if isinstance(spec, int):
        return spec
    lo, hi = spec
    if lo > hi or lo < 1:
        raise ValueError(f"a length range must be (lo, hi) with 1 <= lo <= hi, got {spec}")
    if dist == "uniform":
        return rng.randint(lo, hi)
    if dist == "lognormal":
        # Median at the geometric mean; about 95% of draws inside the range before clipping.
        mu = (math.log(lo) + math.log(hi)) / 2
        sigma = max((math.log(hi) - math.log(lo)) / 4, 1e-6)
        return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))
    raise ValueError(f"length_dist must be 'uniform' or 'lognormal', got {dist!r}")


class _ChatTemplate:
    """The chat template cut into fixed token pieces around the system and user text,
    so a prompt of exactly L tokens is pieces + L - len(pieces) user tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": _SYS}, {"role": "user", "content": _USER}],
            tokenize=False, add_generation_prompt=True,
        )
        before_sys, rest = text.split(_SYS)
        between, after_user = rest.split(_USER)
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self.head, self.between, self.tail = enc(before_sys), enc(between), enc(after_user)

    def ids(self, system_ids: list[int], user_ids: list[int]) -> list[int]:
        return self.head + system_ids + self.between + user_ids + self.tail

    def num_fixed(self, num_system: int) -> int:
        return len(self.head) + num_system + len(self.between) + len(self.tail)


def _prompt_parts(tokenizer: PreTrainedTokenizerBase, shared_prefix_len: int
                  ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """What :func:`iter_workload` cuts prompts from, tokenized once for all ``n`` requests:
    the documentation corpus end to end as one token stream, where each document starts
    in it, the system prompt's ids (the stream's first ``shared_prefix_len`` tokens when
    requests share a prefix, else the default system prompt) and each instruction's ids."""
    docs = _corpus_token_ids(tokenizer)
    stream = [t for d in docs for t in d]  # all documents end to end
    starts = [0]
    for d in docs[:-1]:
        starts.append(starts[-1] + len(d))
    if shared_prefix_len:
        system_ids = stream[:shared_prefix_len]
    else:
        system_ids = tokenizer.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)
    instructions = [tokenizer.encode(i + "\n\n", add_special_tokens=False) for i in INSTRUCTIONS]
    return stream, starts, system_ids, instructions


def iter_workload(
    tokenizer: PreTrainedTokenizerBase | None,
    n: int,
    seed: int = 0,
    prompt_len: int | tuple[int, int] = (20, 300),
    output_len: int | tuple[int, int] = (16, 128),
    length_dist: str = "uniform",
    shared_prefix_len: int = 0,
    rate: float | None = None,
    vocab_size: int = 512,
) -> Iterator[WorkloadRequest]:
    """Yield ``n`` requests one by one (a 10,000-request simulation never holds them all).

    ``prompt_len`` is the length of the whole templated prompt, system prompt included;
    a draw shorter than the template plus one user token is raised to that. With
    ``shared_prefix_len`` N > 0 the system prompt is the same N tokens of documentation in
    every request. ``rate`` None: everything arrives at 0; else Poisson arrivals at
    ``rate`` requests per second. ``tokenizer`` None gives random token ids below
    ``vocab_size`` (for tiny test models), with the same lengths and arrivals.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or None for all at once), got {rate}")
    rng = random.Random(seed)
    # Separate streams, so that changing e.g. the rate leaves the prompts unchanged.
    len_rng, out_rng, arr_rng = (random.Random(rng.random()) for _ in range(3))
    if tokenizer is not None:
        template = _ChatTemplate(tokenizer)
        stream, starts, system_ids, instructions = _prompt_parts(tokenizer, shared_prefix_len)
        fixed = template.num_fixed(len(system_ids))
    else:
        shared = random.Random(seed + 1).choices(range(vocab_size), k=shared_prefix_len)
        fixed = shared_prefix_len
    t = 0.0
    for i in range(n):
        length = _draw_length(len_rng, prompt_len, length_dist)
        max_tokens = _draw_length(out_rng, output_len, length_dist)
        if rate is not None:
            t += arr_rng.expovariate(rate)
        num_user = max(1, length - fixed)
        if tokenizer is not None:
            # Start at a document boundary past the shared prefix; run on into the next ones.
            doc = len_rng.randrange(len(starts))
            start = max(starts[doc], shared_prefix_len)
            instruction = instructions[i % len(instructions)]
            user_ids = (instruction + stream[start : start + num_user])[:num_user]
            ids = template.ids(list(system_ids), user_ids)
            text = tokenizer.decode(user_ids)
        else:
            ids = shared + len_rng.choices(range(vocab_size), k=num_user)
            text = None
        yield WorkloadRequest(str(i), ids, max_tokens, t, text)


def make_workload(tokenizer: PreTrainedTokenizerBase | None, n: int, seed: int = 0, **kwargs) -> list[WorkloadRequest]:
    """All ``n`` requests of :func:`iter_workload` as a list."""
    return list(iter_workload(tokenizer, n, seed, **kwargs))


def chat_workload(
    tokenizer: PreTrainedTokenizerBase | None,
    n: int = 32,
    seed: int = 0,
    prompt_len: int | tuple[int, int] = (20, 300),
    output_len: int | tuple[int, int] = (16, 128),
    **kwargs,
) -> list[WorkloadRequest]:
    """The standard "32-request chat workload" of the issues and notebooks: prompts of
    20-300 tokens, 16-128 output tokens each, all arriving at once (greedy, ignore_eos)."""
    return make_workload(tokenizer, n, seed, prompt_len=prompt_len, output_len=output_len, **kwargs)


COPY_INSTRUCTION = "Repeat the following text exactly, word for word, and nothing else:\n\n"


def copy_workload(
    tokenizer: PreTrainedTokenizerBase,
    n: int = 32,
    seed: int = 0,
    text_len: tuple[int, int] = (60, 160),
) -> list[WorkloadRequest]:
    """Requests whose answers copy from the prompt: "repeat this text" over a stretch of
    standard-library documentation (code examples included) of ``text_len`` tokens, and
    as many output tokens as the text has. Where speculative decoding's n-gram drafts
    pay best (``minivllm bench speculative``); all arrive at once (greedy, ignore_eos)."""
    rng = random.Random(seed)
    template = _ChatTemplate(tokenizer)
    system_ids = tokenizer.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)
    instruction = tokenizer.encode(COPY_INSTRUCTION, add_special_tokens=False)
    docs = [d for d in _corpus_token_ids(tokenizer) if len(d) >= text_len[0]]
    out = []
    for i in range(n):
        doc = rng.choice(docs)
        text = list(doc[: rng.randint(text_len[0], min(text_len[1], len(doc)))])
        ids = template.ids(list(system_ids), instruction + text)
        out.append(WorkloadRequest(str(i), ids, len(text), 0.0, tokenizer.decode(instruction + text)))
    return out


def summarize(workload: list[WorkloadRequest]) -> dict[str, float]:
    """Counts a benchmark table needs: requests, prompt and output tokens, span of arrivals."""
    p = [r.num_prompt_tokens for r in workload]
    o = [r.max_tokens for r in workload]
    return {
        "num_requests": len(workload),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "min_prompt": min(p, default=0),
        "max_prompt": max(p, default=0),
        "min_output": min(o, default=0),
        "max_output": max(o, default=0),
        "last_arrival": max((r.arrival_time for r in workload), default=0.0),
    }


DOCUMENT_QUESTIONS = (
    "What is this for?", "Give one example of its use.", "What can go wrong with it?",
    "Summarize it in one sentence.", "Which argument matters most, and why?",
    "How would you explain it to a beginner?", "What does it return?", "When should it not be used?",
)


def document_workload(
    tokenizer: PreTrainedTokenizerBase | None,
    num_documents: int = 8,
    questions_per_document: int = 4,
    seed: int = 0,
    document_len: int = 256,
    output_len: int | tuple[int, int] = (16, 64),
    rate: float | None = None,
    vocab_size: int = 512,
) -> list[WorkloadRequest]:
    """Requests in groups that share a long prefix: ``num_documents`` documents of
    ``document_len`` tokens, each asked ``questions_per_document`` questions (the user
    pastes a document, then asks about it several times, as in a multi-turn chat over
    a file). Within a group every prompt starts with the same template and document, so
    a replica that served one question holds the blocks the next question needs; across
    groups only the template is shared. This is the workload on which the choice of
    replica decides the prefix-cache hit rate (``minivllm bench router``, notebook 14).

    The questions of all documents are interleaved in a seeded random order; ``rate``
    None: all arrive at 0, else Poisson arrivals at ``rate`` requests per second.
    ``tokenizer`` None: random token ids below ``vocab_size`` (tiny test models).
    """
    if num_documents < 1 or questions_per_document < 1 or document_len < 1:
        raise ValueError("num_documents, questions_per_document and document_len must be >= 1")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or None for all at once), got {rate}")
    rng = random.Random(seed)
    order = [(d, q) for d in range(num_documents) for q in range(questions_per_document)]
    rng.shuffle(order)
    if tokenizer is not None:
        template = _ChatTemplate(tokenizer)
        system_ids = tokenizer.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)
        stream = [t for d in _corpus_token_ids(tokenizer) for t in d]
        starts = rng.sample(range(0, len(stream) - document_len), num_documents)
        documents = [stream[s:s + document_len] for s in starts]
        questions = [tokenizer.encode("\n\n" + q, add_special_tokens=False) for q in DOCUMENT_QUESTIONS]
    else:
        documents = [rng.choices(range(vocab_size), k=document_len) for _ in range(num_documents)]
        questions = [rng.choices(range(vocab_size), k=8) for _ in DOCUMENT_QUESTIONS]
    t, out = 0.0, []
    for d, q in order:
        if rate is not None:
            t += rng.expovariate(rate)
        user = documents[d] + questions[(d + q) % len(questions)]
        ids = template.ids(list(system_ids), user) if tokenizer is not None else list(user)
        text = tokenizer.decode(questions[(d + q) % len(questions)]).strip() if tokenizer is not None else None
        out.append(WorkloadRequest(f"doc{d}-q{q}", ids, _draw_length(rng, output_len, "uniform"), t,
                                   f"[document {d}] {text}" if text else None))
    return out
