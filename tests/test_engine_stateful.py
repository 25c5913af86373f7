"""Random schedules at scale: a hypothesis state machine over the engine on the simulated runner.

Each example builds one small engine (``minivllm.sim.simulator.make_simulated_engine``:
the real scheduler, KV cache manager and front end, a cost-model runner on a virtual
clock, so a step costs microseconds) with a configuration hypothesis chooses: a KV cache
barely larger than one request (preemption pressure), 2 or 4 tokens per block, a small
step budget with or without chunked prefill, prefix caching on or off, "fcfs" or
"priority", n-gram speculative decoding on or off. It then runs a random schedule of
these rules:

* add a burst of requests: prompts over a three-token alphabet, half of them a prefix of
  an earlier prompt plus a new tail (prefix-cache hits), random ``max_tokens`` (or none:
  up to ``max_model_len``), ``n`` in 1..3, a stop token after ``min_tokens``, a seed, a
  priority under "priority", sometimes a ``cache_salt``;
* add a request the engine must refuse (empty, too long, over the budget without chunked
  prefill, a priority under "fcfs", structured output, an id in use): a ValidationError,
  and nothing left behind;
* abort a live request (or one child of an ``n > 1`` request), and abort one that has
  finished already (a KeyError that changes nothing);
* step once, step a few times, drain (step until nothing is unfinished, within a bound, so
  a livelock fails instead of hanging); a step whose forward pass fails (rolled back);
  reset the prefix cache (refused while any block is in use).

After every engine step and every rule it checks: the KV cache manager's
``check_invariants()``; free plus used blocks is every block and no ref count is negative;
every block is free whenever no request is unfinished; the requests the engine holds are
exactly those the test expects (none lost, none extra); the engine's metrics agree with
the outputs handed out (tokens generated, requests finished by reason, the gauges);
and of every output: it belongs to a live request, its tokens only grow, it ends once,
with exactly the finish reason and length its stop rules give ("stop" at the stop token,
"length" at ``max_tokens`` or ``max_model_len``), an aborted completion gets no token after
its abort, and its final output (reason "abort") comes with the next step. Every example
ends with a drain: each request got exactly one final output, every block is free again.

Speculative decoding: the shipped simulated runner returns one token per request and so
rejects every draft. The runner here (:class:`SpeculatingRunner`) is a greedy target that
always predicts the simulator's token, so it accepts the drafts that equal it, as the
rejection sampler would: steps give several tokens and rejected drafts give blocks back.

Left out: structured output runs (the simulated engine has no tokenizer, and a grammar is
over text: such a request is refused, which the machine checks); logprobs (the simulated
runner computes none); token contents beyond "every token is the simulator's" (there is
no model: transformers is the oracle for tokens, in the other test files); stop strings
(text needs a tokenizer); reusing the id of an aborted request before its final output.

Every run does at least 1,000 examples of up to 40 rules; the long run, 100,000::

    pytest tests/test_engine_stateful.py --hypothesis-profile long

(the profile is registered in ``tests/conftest.py``; add ``--hypothesis-show-statistics``
to see the count and the time).
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.exceptions import ValidationError
from minivllm.sample.structured_output import StructuredOutputsParams
from minivllm.sampling_params import SamplingParams
from minivllm.sim.cost_model import CostModel
from minivllm.sim.simulator import SimulatedModelRunner, make_simulated_engine

COST_MODEL = CostModel.load()
"""The shipped cost model: only simulated seconds depend on it, and none is checked here."""
MIN_EXAMPLES = 1000
MAX_DRAIN_STEPS = 2000
"""A drain of at most a few dozen short requests takes a few hundred steps, even
thrashing; more means the engine stopped making progress."""
COVERAGE: Counter = Counter()
"""What the machine exercised over the whole run, read by the test after it."""


class InjectedStepFailure(RuntimeError):
    """The forward pass failing, on purpose (``fail_step``)."""


class SpeculatingRunner(SimulatedModelRunner):
    """The simulated runner as a greedy target that always predicts ``token_id``: a draft
    is accepted while it equals that token, as rejection sampling would accept it, then
    the target's own token follows. It can also fail its next step on demand."""

    fail_next = False

    def execute_model(self, scheduler_output):
        if self.fail_next:
            self.fail_next = False
            raise InjectedStepFailure("the forward pass failed (injected)")
        out = super().execute_model(scheduler_output)
        for s in scheduler_output.scheduled:
            if s.samples and s.spec_token_ids:
                agreed = itertools.takewhile(lambda t: t == self.token_id, s.spec_token_ids)
                out.sampled[s.request.request_id] = [*agreed, self.token_id]
        return out


@st.composite
def engine_configs(draw) -> dict:
    """Small engines, so that memory, seats and the step budget all run out often."""
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.integers(8, 20))
    blocks_for_one = -(-max_model_len // block_size)  # one longest request must fit alone
    speculative = draw(st.none() | st.fixed_dictionaries(
        {"method": st.just("ngram"), "num_speculative_tokens": st.integers(1, 3),
         "prompt_lookup_max": st.integers(1, 3), "prompt_lookup_min": st.just(1)},
        optional={"adaptive": st.booleans(), "disable_by_batch_size": st.integers(1, 3)}))
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_kv_blocks": draw(st.integers(blocks_for_one, 2 * blocks_for_one)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "max_num_batched_tokens": draw(st.integers(4, 24)),
        "enable_chunked_prefill": draw(st.booleans()),
        "enable_prefix_caching": draw(st.booleans() | st.just(True)),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "speculative_config": speculative,
    }


@dataclass
class Tracked:
    """One request as the test knows it: what it asked for, and what step() handed out.
    Completion ``i`` is child ``i`` of an ``n > 1`` request."""

    request_id: str
    child_ids: list[str]
    prompt_len: int
    expected: list[tuple[str, int]]
    """Per completion: the finish reason and length its stop rules give, if not aborted."""
    tokens: list[list[int]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    aborted_at: dict[int, int] = field(default_factory=dict)
    """Completion index -> its length when it was aborted."""
    final: bool = False
    """Its one finished output has been handed out."""

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.child_ids]
        self.reasons = [None for _ in self.child_ids]

    def unfinished(self) -> list[int]:
        """Completions the engine core still runs (neither finished nor aborted)."""
        return [i for i, r in enumerate(self.reasons) if r is None and i not in self.aborted_at]


def expected_end(prompt_len: int, params: SamplingParams, max_model_len: int,
                 token: int) -> tuple[str, int]:
    """Where a completion ends when every token is ``token``: the scheduler's stop rules,
    in their order (a stop token first, then max_tokens, then max_model_len)."""
    limit = max_model_len - prompt_len
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens)
    if token in params.stop_token_ids:
        stop_at = max(params.min_tokens, 1)
        if stop_at <= limit:
            return "stop", stop_at
    return "length", limit


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.requests: dict[str, Tracked] = {}
        self.prompts: list[list[int]] = []
        self.ids = itertools.count()
        self.seen = Counter()
        """What this example exercised (added to COVERAGE at the end)."""

    # -- the engine ---------------------------------------------------------------------
    @initialize(config=engine_configs())
    def build(self, config: dict) -> None:
        engine = make_simulated_engine(COST_MODEL, **config)
        shipped = engine.model_runner
        # Swapped in after the fact: make_simulated_engine takes no runner of its own.
        runner = SpeculatingRunner(shipped.cost_model, shipped.clock, shipped.token_id)
        engine.executor.model_runner = engine.model_runner = runner
        self.engine, self.config, self.runner = engine, config, runner
        self.token = runner.token_id
        self.alphabet = [1, self.token, self.token + 1]  # the simulator's token: drafts that pass
        self.pool = engine.kv_cache_manager.block_pool
        for key in ("scheduling_policy", "enable_chunked_prefill", "enable_prefix_caching"):
            self.seen[f"{key}={config[key]}"] += 1
        self.seen[f"speculative={config['speculative_config'] is not None}"] += 1

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt the engine accepts: shorter than max_model_len and, without
        chunked prefill, within one step's budget."""
        longest = self.config["max_model_len"] - 1
        if not self.config["enable_chunked_prefill"]:
            longest = min(longest, self.config["max_num_batched_tokens"])
        return longest

    def live(self) -> list[Tracked]:
        return [t for t in self.requests.values() if t.unfinished()]

    def done(self) -> list[Tracked]:
        return [t for t in self.requests.values() if not t.unfinished()]

    # -- adding -------------------------------------------------------------------------
    def draw_prompt(self, data: st.DataObject, max_len: int) -> list[int]:
        """A new prompt; half the time an earlier prompt's prefix plus a new tail."""
        tokens = st.sampled_from(self.alphabet)
        prompt: list[int] = []
        if self.prompts and data.draw(st.booleans(), label="shares a prefix"):
            earlier = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
            prompt = earlier[:data.draw(st.integers(1, min(len(earlier), max_len)), label="kept")]
        return prompt + data.draw(st.lists(tokens, min_size=0 if prompt else 1,
                                           max_size=max_len - len(prompt)), label="tail")

    def draw_params(self, data: st.DataObject) -> SamplingParams:
        max_tokens = data.draw(st.integers(1, 8) | st.none(), label="max_tokens")
        stops = data.draw(st.booleans(), label="stop token")
        return SamplingParams(
            max_tokens=max_tokens,
            n=data.draw(st.integers(1, 3), label="n"),
            ignore_eos=True,
            stop_token_ids=[self.token] if stops else None,
            min_tokens=data.draw(st.integers(0, max_tokens or 8), label="min_tokens") if stops else 0,
            temperature=data.draw(st.sampled_from([0.0, 0.8]), label="temperature"),
            seed=data.draw(st.none() | st.integers(0, 2**16), label="seed"),
        )

    @rule(data=st.data(), burst=st.integers(1, 3))
    def add_requests(self, data: st.DataObject, burst: int) -> None:
        for _ in range(burst):
            prompt = self.draw_prompt(data, self.max_prompt_len)
            params = self.draw_params(data)
            priority = 0
            if self.config["scheduling_policy"] == "priority":
                priority = data.draw(st.integers(-2, 2), label="priority")
            salt = data.draw(st.sampled_from([None, "tenant-b"]), label="cache_salt")
            request_id = f"r{next(self.ids)}"
            added = self.engine.add_request(
                request_id, {"prompt_token_ids": prompt, "cache_salt": salt}, params, priority=priority)
            children = added if isinstance(added, list) else [added]
            end = expected_end(len(prompt), params, self.engine.max_model_len, self.token)
            self.requests[request_id] = Tracked(request_id, [c.request_id for c in children],
                                                len(prompt), [end] * params.n)
            self.prompts.append(prompt)
            self.seen[f"n={params.n}"] += 1
            self.check_engine()

    @rule(data=st.data())
    def add_refused(self, data: st.DataObject) -> None:
        """A request that could never be served is refused before anything is queued."""
        kinds = ["empty prompt", "prompt too long", "structured output"]
        if self.config["scheduling_policy"] == "fcfs":
            kinds.append("priority under fcfs")
        if not self.config["enable_chunked_prefill"] and self.max_prompt_len < self.engine.max_model_len - 1:
            kinds.append("over the budget")
        if self.live():
            kinds.append("id in use")
        kind = data.draw(st.sampled_from(kinds), label="refused because")
        request_id, prompt, params, priority = f"r{next(self.ids)}", [1], SamplingParams(), 0
        if kind == "empty prompt":
            prompt = []
        elif kind == "prompt too long":
            prompt = [1] * self.engine.max_model_len
        elif kind == "over the budget":
            prompt = [1] * (self.max_prompt_len + 1)
        elif kind == "structured output":  # needs a tokenizer, which the simulated engine has not
            params = SamplingParams(n=data.draw(st.integers(1, 2)),
                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        elif kind == "priority under fcfs":
            priority = 1
        else:
            request_id = data.draw(st.sampled_from([t.request_id for t in self.live()]), label="id in use")
        before = self.snapshot()
        with pytest.raises(ValidationError):
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params, priority=priority)
        assert self.snapshot() == before, kind
        if kind != "id in use":
            assert not self.engine.has_request(request_id), kind
        self.seen[f"refused: {kind}"] += 1

    def snapshot(self) -> tuple:
        """What a refused request or a refused abort must leave as it was."""
        return (self.engine.get_num_unfinished_requests(), self.engine.has_unfinished_requests(),
                self.pool.get_num_free_blocks(), [b.ref_cnt for b in self.pool.blocks])

    # -- aborting -----------------------------------------------------------------------
    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort_live(self, data: st.DataObject) -> None:
        """Abort a running or waiting request, or one child of an ``n > 1`` request."""
        tracked = data.draw(st.sampled_from(self.live()), label="request")
        targets = tracked.unfinished()
        if len(tracked.child_ids) > 1 and data.draw(st.booleans(), label="one child"):
            targets = [data.draw(st.sampled_from(targets), label="child")]
            self.engine.abort_request(tracked.child_ids[targets[0]])
        else:
            self.engine.abort_request(tracked.request_id)
        for i in targets:
            tracked.aborted_at[i] = len(tracked.tokens[i])
        self.seen["aborted"] += 1
        self.check_engine()

    @precondition(lambda self: self.done())
    @rule(data=st.data())
    def abort_finished(self, data: st.DataObject) -> None:
        """Aborting a request that has finished (or was aborted) is a KeyError and changes nothing."""
        tracked = data.draw(st.sampled_from(self.done()), label="request")
        before = self.snapshot()
        with pytest.raises(KeyError):
            self.engine.abort_request(tracked.request_id)
        assert self.snapshot() == before
        self.seen["aborted a finished request"] += 1

    # -- stepping -----------------------------------------------------------------------
    @rule()
    def step(self) -> None:
        self.step_once()

    @rule(steps=st.integers(2, 8))
    def run_steps(self, steps: int) -> None:
        for _ in range(steps):
            self.step_once()

    @rule()
    def drain(self) -> None:
        self.drain_and_check()

    @precondition(lambda self: self.live())
    @rule()
    def fail_step(self) -> None:
        """A failing forward pass is rolled back: the engine is as before, and goes on."""
        self.runner.fail_next = True
        with pytest.raises(InjectedStepFailure):
            self.engine.step()
        assert not self.runner.fail_next, "the step never reached the forward pass"
        self.seen["failed step"] += 1
        self.check_engine()

    @rule()
    def reset_prefix_cache(self) -> None:
        """Refused (False) while any block is in use; done (True) when all are free."""
        all_free = self.pool.get_num_free_blocks() == self.pool.num_blocks
        assert self.engine.reset_prefix_cache() == all_free

    def step_once(self) -> None:
        """One engine step, every output checked, then the engine."""
        for out in self.engine.step():
            self.check_output(out)
        for tracked in self.requests.values():  # an abort's final output comes with the next step
            assert tracked.final or tracked.unfinished(), f"{tracked.request_id} never got its final output"
        self.check_engine()

    def drain_and_check(self) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self.step_once()
        else:
            pytest.fail(f"still unfinished after {MAX_DRAIN_STEPS} steps: {self.live()}")
        lost = [t.request_id for t in self.requests.values() if not t.final]
        assert not lost, f"requests without a final output: {lost}"
        assert self.engine.get_num_unfinished_requests() == 0
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)

    # -- the checks ---------------------------------------------------------------------
    def check_output(self, out) -> None:
        """One RequestOutput against what its request asked for and what it had before."""
        tracked = self.requests.get(out.request_id)
        assert tracked is not None, f"output for a request never added: {out.request_id}"
        assert not tracked.final, f"output after the final one: {out}"
        assert [c.index for c in out.outputs] == list(range(len(tracked.child_ids))), out
        assert 0 <= out.num_cached_tokens < tracked.prompt_len
        assert out.num_cached_tokens % self.config["block_size"] == 0
        if not self.config["enable_prefix_caching"]:
            assert out.num_cached_tokens == 0
        for i, completion in enumerate(out.outputs):
            self.check_completion(tracked, i, completion)
        assert out.finished == all(c.finish_reason is not None for c in out.outputs), out
        tracked.final = out.finished

    def check_completion(self, tracked: Tracked, i: int, c) -> None:
        before = tracked.tokens[i]
        assert c.token_ids[:len(before)] == before, "a completion's tokens only ever grow"
        assert set(c.token_ids) <= {self.token}, "a token the runner never sampled (a rejected draft?)"
        if tracked.reasons[i] is not None:
            assert (c.finish_reason, c.token_ids) == (tracked.reasons[i], before), "changed after finishing"
        if i in tracked.aborted_at:
            # None: an n > 1 request's output made when another child was aborted before
            # this one (each abort makes one; the next step hands them out in order).
            assert c.finish_reason in (None, "abort"), c
            assert len(c.token_ids) == tracked.aborted_at[i], "tokens after its abort"
        else:
            reason, length = tracked.expected[i]
            assert len(c.token_ids) <= length, (c, tracked.expected[i])
            if c.finish_reason is not None or len(c.token_ids) == length:
                assert (c.finish_reason, len(c.token_ids)) == (reason, length), (c, tracked)
        tracked.tokens[i], tracked.reasons[i] = list(c.token_ids), c.finish_reason

    @invariant()
    def engine_is_consistent(self) -> None:
        if self.engine is not None:
            self.check_engine()

    def check_engine(self) -> None:
        """Blocks, the requests the engine holds, and its metrics, against the test's books."""
        self.engine.kv_cache_manager.check_invariants()
        pool = self.pool
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert pool.get_num_free_blocks() + used == pool.num_blocks
        unfinished = sum(len(t.unfinished()) for t in self.requests.values())
        assert self.engine.get_num_unfinished_requests() == unfinished, "a request was lost or made up"
        assert self.engine.has_unfinished_requests() == any(not t.final for t in self.requests.values())
        if unfinished == 0:
            assert used == 0, "blocks held with no request unfinished"
        self.check_metrics(unfinished, used)

    def check_metrics(self, unfinished: int, used: int) -> None:
        metrics = {(m.name.removeprefix("minivllm:"), tuple(m.labels.values())): m
                   for m in self.engine.get_metrics()}

        def value(name: str, *labels: str):
            return metrics[(name, labels)].value

        assert value("num_requests_running") + value("num_requests_waiting") == unfinished
        assert value("kv_cache_usage_perc") == pytest.approx(used / self.pool.num_blocks)
        assert value("prefix_cache_hits") <= value("prefix_cache_queries")
        tokens = sum(len(t) for tracked in self.requests.values() for t in tracked.tokens)
        assert value("generation_tokens") == tokens
        finished = Counter()
        for tracked in self.requests.values():
            finished["abort"] += len(tracked.aborted_at)
            finished.update(r for i, r in enumerate(tracked.reasons)
                            if r is not None and i not in tracked.aborted_at)
        for reason in ("stop", "length", "abort"):
            assert value("request_success", reason) == finished[reason], reason
        if self.config["speculative_config"] is not None:
            assert value("spec_decode_num_accepted_tokens") <= value("spec_decode_num_draft_tokens")

    def teardown(self) -> None:
        """Every example ends with a drain; not after a failure (sys.exc_info() is set
        while one propagates), whose own error must not be hidden by a second one."""
        COVERAGE["examples"] += 1
        if self.engine is None or sys.exc_info()[0] is not None:
            return
        self.drain_and_check()
        metrics = {m.name.removeprefix("minivllm:"): m.value for m in self.engine.get_metrics()
                   if not m.labels and hasattr(m, "value")}
        self.seen["preemptions"] += metrics["num_preemptions"]
        self.seen["prefix-cache hit tokens"] += metrics["prefix_cache_hits"]
        if "spec_decode_num_drafts" in metrics:
            accepted = metrics["spec_decode_num_accepted_tokens"]
            self.seen["accepted drafts"] += accepted
            self.seen["rejected drafts"] += metrics["spec_decode_num_draft_tokens"] - accepted
        for tracked in self.requests.values():
            self.seen.update(f"finished: {r}" for r in tracked.reasons)
        COVERAGE.update(self.seen)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    # At least MIN_EXAMPLES; more when the loaded profile asks for more ("long").
    max_examples=max(MIN_EXAMPLES, settings.default.max_examples),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_machine_exercised_every_feature():
    """The machine above (it runs just before this test) ran its examples and reached
    everything it is meant to cover: a machine that never preempts checks little."""
    if not COVERAGE["examples"]:
        pytest.skip("counts come from the state machine, which did not run")
    print(f"\nstate machine coverage: {dict(sorted(COVERAGE.items()))}")
    assert COVERAGE["examples"] >= MIN_EXAMPLES, "the state machine stopped early (did it fail?)"
    for what in ("preemptions", "prefix-cache hit tokens", "accepted drafts", "rejected drafts",
                 "aborted", "aborted a finished request", "failed step", "n=3",
                 "finished: stop", "finished: length", "finished: abort",
                 "refused: structured output", "refused: priority under fcfs",
                 "scheduling_policy=priority", "enable_chunked_prefill=False",
                 "enable_prefix_caching=False"):
        assert COVERAGE[what] > 0, f"the machine never exercised {what!r}: {COVERAGE}"
