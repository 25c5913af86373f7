"""Speculative decoding (n-gram drafts): exact outputs, block accounting, metrics.

The reference is the engine without speculation and transformers' generate(): greedy
output must be token for token the same, whatever the budget, block size, preemption,
prefix caching or chunking; sampled output must have the target's distribution.
"""

from __future__ import annotations

import argparse
import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from helpers import all_blocks_free, greedy, hf_greedy
from scipy.stats import chisquare
from tiny_chat import tiny_chat_llm

from minivllm import LLM, EngineConfig, SamplingParams, viz
from minivllm.core.kv_cache_manager import cdiv
from minivllm.engine.arg_utils import add_engine_arguments, engine_kwargs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exceptions import ValidationError
from minivllm.metrics import Counter, LoggingStatLogger
from minivllm.spec_decode.draft_length import EXPLORE_EVERY, AdaptiveDraftLength, band
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.rejection_sampler import RejectionSampler
from minivllm.worker.model_loader import TINY_ARCHS, make_tiny_model
from minivllm.worker.model_runner import ModelRunnerOutput

VOCAB = 64
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "adaptive": False}
"""A fixed draft length, so that every test sees drafts verified; "adaptive" is tested apart."""


def copying_workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts that repeat a short random phrase (so the proposer finds matches) with a
    few random tokens mixed in (so some drafts are rejected too); 1..40 output tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
        prompt = (phrase * 8)[: rng.randint(8, 90)]
        for _ in range(rng.randint(0, 3)):
            prompt[rng.randrange(len(prompt))] = rng.randrange(VOCAB)
        prompts.append(prompt)
    return prompts, [rng.randint(1, 40) for _ in range(n)]


def generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in lengths],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def spec_counts(llm: LLM) -> dict[str, int]:
    return {m.name.removeprefix("minivllm:spec_decode_"): m.value for m in llm.get_metrics()
            if isinstance(m, Counter) and m.name.startswith("minivllm:spec_decode") and not m.labels}


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request):
    model = make_tiny_model(request.param, vocab_size=VOCAB)
    prompts, lengths = copying_workload(12, seed=3)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return model, prompts, lengths, refs


CONFIGS = {
    "ample": dict(),
    "budget16": dict(max_num_batched_tokens=16),
    "preempting": dict(num_kv_blocks=14, max_num_batched_tokens=64),
    "block1": dict(block_size=1, max_num_batched_tokens=64),
    "block32": dict(block_size=32),
    "no_chunking_no_prefix_cache": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    "k8": dict(speculative_config={**SPEC, "num_speculative_tokens": 8, "prompt_lookup_max": 2}),
    "adaptive": dict(speculative_config={**SPEC, "adaptive": True}),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_is_token_identical_with_speculation(tiny, name):
    model, prompts, lengths, refs = tiny
    cfg = {"speculative_config": SPEC, "log_stats_interval": None, **CONFIGS[name]}
    llm = LLM(model, **cfg)
    assert generate(llm, prompts, lengths) == refs
    plain = LLM(model, **{**cfg, "speculative_config": None})
    assert generate(plain, prompts, lengths) == refs
    counts = spec_counts(llm)
    steps = list(llm.trace.steps)
    if name != "adaptive":  # there the engine may choose to verify fewer drafts, or none
        # Both paths ran: drafts accepted (several tokens in one step) and drafts rejected.
        assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
        assert len(steps) < len(list(plain.trace.steps))
    k = cfg["speculative_config"]["num_speculative_tokens"]
    assert max(c.num_draft_tokens for s in steps for c in s.scheduled) <= k
    budget = llm.llm_engine.config.max_num_batched_tokens
    assert max(s.num_tokens for s in steps) <= budget, "drafts count in the token budget"
    if name == "preempting":
        assert sum(len(s.preempted) for s in steps) > 0
    if name == "budget16":  # drafts shared steps with prompt chunks
        assert any(any(c.is_prefill for c in s.scheduled) and any(c.num_draft_tokens for c in s.scheduled)
                   for s in steps)
    assert all_blocks_free(llm)


def test_prefix_cache_hits_with_speculation(tiny):
    """Requests sharing a prefix, sent in two waves: the second finds the first's blocks
    (K/V written partly by accepted drafts) and still decodes exactly."""
    model, prompts, _, _ = tiny
    shared = prompts[0] * 3
    wave = [shared[:40] + p[:10] for p in prompts[:6]]
    refs = [hf_greedy(model, p, 24) for p in wave]
    llm = LLM(model, speculative_config=SPEC, log_stats_interval=None, block_size=4)
    assert generate(llm, wave[:3], [24] * 3) == refs[:3]
    assert generate(llm, wave, [24] * 6) == refs
    assert sum(sum(s.prefix_cache_hits.values()) for s in llm.trace.steps) > 0
    assert all_blocks_free(llm)


def test_rollback_leaves_every_block_accounted_for(tiny):
    """After every step: the pool's invariants hold, and a running request owns exactly
    the blocks its computed tokens fill (rejected drafts' now-empty blocks were freed)."""
    model, prompts, lengths, refs = tiny
    llm = LLM(model, speculative_config=SPEC, log_stats_interval=None, block_size=2,
              num_kv_blocks=60, max_num_batched_tokens=48)
    engine = llm.llm_engine
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(n))
    outputs, freed = {}, 0
    while engine.has_unfinished_requests():
        before = engine.kv_cache_manager.block_pool.get_num_free_blocks()
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        kv = engine.kv_cache_manager
        kv.check_invariants()
        for r in engine.scheduler.running:
            assert len(kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, kv.block_size)
        freed += kv.block_pool.get_num_free_blocks() > before
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert all_blocks_free(llm)


# -- stops: nothing past a stop, even when several tokens are accepted at once ----------
def stop_cases(text: str, token_ids: list[int]) -> list[dict]:
    mid = len(text) // 2
    return [
        dict(stop=[text[mid : mid + 3]]),
        dict(stop=[text[mid : mid + 3], text[-4:]]),
        dict(stop_token_ids=[token_ids[12]]),
        dict(stop_token_ids=[token_ids[3]], min_tokens=10),
        dict(stop=[text[5:8]], min_tokens=20),
        dict(max_tokens=7),
    ]


def looping_chat_llm(**kwargs) -> LLM:
    """A tiny random model with SmolLM2's tokenizer that only ever writes a few dozen
    common words (the other rows of its output layer are zero), so its greedy text falls
    into loops: the n-gram proposer's drafts then get accepted several at a time."""
    llm = tiny_chat_llm(**kwargs)
    tokenizer = llm.get_tokenizer()
    words = tokenizer(" the cat sat on a mat and dog ran to big red house, then. it was not"
                      " very far from here; we saw\n trees")["input_ids"]
    lm_head = llm.llm_engine.model.lm_head.weight
    with torch.no_grad():
        keep = lm_head[words].clone() * 10
        lm_head.zero_()
        lm_head[words] = keep
    return llm


def test_stops_are_exact_with_speculation():
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n\ndef add(a, b):",
               "one two three one two three one two"]
    plain = looping_chat_llm()
    spec = looping_chat_llm(speculative_config=SPEC)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    firsts = plain.generate(prompts, base, use_tqdm=False)
    stopped_in_a_multi_token_step = 0
    for prompt, first in zip(prompts, firsts):
        out = first.outputs[0]
        for case in stop_cases(out.text, out.token_ids):
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **case})
            a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            result = spec.generate(prompt, params, use_tqdm=False)[0]
            b = result.outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                   (a.token_ids, a.text, a.finish_reason, a.stop_reason), (prompt, case)
            last = [c for s in spec.trace.steps for c in s.scheduled if c.request_id == result.request_id][-1]
            stopped_in_a_multi_token_step += b.finish_reason == "stop" and last.num_accepted_tokens > 0
    # The case that matters happened: a stop inside a step that accepted drafts.
    assert stopped_in_a_multi_token_step > 0
    assert any(c.num_accepted_tokens >= 2 for s in spec.trace.steps for c in s.scheduled)
    assert all_blocks_free(spec)


# -- sampling: the output distribution is the target's ----------------------------------
def chi2_pvalue(counts, probs) -> float:
    """Pearson's chi-square test of observed ``counts`` against probabilities ``probs``."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    return chisquare(counts.numpy(), (probs / probs.sum() * counts.sum()).numpy()).pvalue


def test_rejection_sampler_keeps_the_target_distribution():
    """Fixed target rows and drafts: the first emitted token is distributed as row 0,
    and, given the first draft was accepted, the next one as row 1 (chi-square)."""
    torch.manual_seed(0)
    vocab, n = 6, 6000
    logits = torch.randn(3, vocab)
    probs = logits.softmax(-1)
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]  # a likely and an unlikely draft
    sampler, gen = RejectionSampler(), torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    outs = [sampler(logits, drafts, params, gen) for _ in range(n)]
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=vocab)
    assert chi2_pvalue(first, probs[0]) > 1e-3
    seconds = [o[1] for o in outs if o[0] == drafts[0]]
    second = torch.bincount(torch.tensor(seconds), minlength=vocab)
    assert chi2_pvalue(second, probs[1]) > 1e-3
    # Both outcomes occurred: the unlikely second draft was mostly rejected.
    assert 0 < sum(o[1] == drafts[1] for o in outs if len(o) > 1) < len(seconds) / 2


def sequence_probabilities(model, prompt: list[int], vocab: int, length: int) -> dict[tuple, float]:
    """The exact probability of every output sequence of ``length`` tokens (sampling at
    temperature 1), from transformers' forward pass over every prefix."""
    seqs = list(itertools.product(range(vocab), repeat=length))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    out = {}
    for i, s in enumerate(seqs):
        pos = len(prompt) - 1
        out[s] = float(sum(logp[i, pos + j, t] for j, t in enumerate(s)).exp())
    return out


def test_sampled_sequences_follow_the_target_distribution():
    """Statistical test on a 4-token vocabulary: 3000 seeded requests of 3 tokens each;
    the counts of the 64 possible sequences match the exact target probabilities
    (chi-square, p > 0.001), with and without speculation."""
    vocab, length, n = 4, 3, 3000
    model = make_tiny_model("llama", vocab_size=vocab, seed=2)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    exact = sequence_probabilities(model, prompt, vocab, length)
    for spec in (SPEC, None):
        llm = LLM(model, speculative_config=spec, log_stats_interval=None, max_num_seqs=256,
                  max_num_batched_tokens=2048)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                            [SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=i)
                             for i in range(n)], use_tqdm=False)
        counts = dict.fromkeys(sorted(exact), 0)
        for o in outs:
            counts[tuple(o.outputs[0].token_ids)] += 1
        assert chi2_pvalue(list(counts.values()), [exact[s] for s in counts]) > 1e-3, spec
        if spec is not None:
            c = spec_counts(llm)
            assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"]


# -- metrics, counted on a hand-worked case -------------------------------------------
class ScriptedRunner:
    """A target model that always continues with ``script`` (greedy, exact): drafts
    are accepted while they match it, then its next token is emitted. With it the
    drafts and acceptances of a run can be worked out by hand."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        sampled = {}
        for s in scheduler_output.scheduled:
            if not s.samples:
                continue
            pos = s.request.num_output_tokens
            accepted = 0
            while accepted < len(s.spec_token_ids) and \
                    s.spec_token_ids[accepted] == self.script[pos + accepted]:
                accepted += 1
            tokens = self.script[pos : pos + accepted + 1]
            sampled[s.request.request_id] = tokens
        return ModelRunnerOutput(sampled, 0.0)

    def remove_requests(self, request_ids) -> None:
        pass


def test_spec_decode_metrics_on_a_hand_worked_case():
    """Prompt 5 6 7 5 6, k = 2, n-grams of 1..2 tokens, max_tokens 6; the target says
    7 5 9 9 9 9. By hand:
      step 1 (prefill) -> 7.         Suffix "6 7" occurred at 1..2: drafts [5, 6].
      step 2: 5 accepted, 6 rejected (target: 9) -> 5 9.  "9" never occurred: no drafts.
      step 3 (plain decode) -> 9.    Suffix "9" at 7; 2 tokens left, 1 may be a draft: [9].
      step 4: 9 accepted, bonus 9 -> 9 9 (6 tokens: finished by length).
    So 2 drafts, 3 draft tokens, 2 accepted: position 0 twice, position 1 never."""
    model = make_tiny_model("llama", vocab_size=16)
    config = EngineConfig(model="tiny", log_stats_interval=None, speculative_config={
        "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    engine = LLMEngine(config, model, None, model_runner=ScriptedRunner([7, 5, 9, 9, 9, 9]))
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 5, 6]},
                       SamplingParams(temperature=0.0, max_tokens=6))
    per_step = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        per_step.append(outs[0].outputs[0].token_ids)
    assert per_step == [[7], [7, 5, 9], [7, 5, 9, 9], [7, 5, 9, 9, 9, 9]]
    assert outs[0].outputs[0].finish_reason == "length"
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in engine.get_metrics()
               if isinstance(m, Counter)}
    p = "minivllm:spec_decode_"
    assert metrics[(p + "num_drafts", ())] == 2
    assert metrics[(p + "num_draft_tokens", ())] == 3
    assert metrics[(p + "num_accepted_tokens", ())] == 2
    assert metrics[(p + "num_accepted_tokens_per_pos", (("position", "0"),))] == 2
    assert metrics[(p + "num_accepted_tokens_per_pos", (("position", "1"),))] == 0
    assert metrics[("minivllm:generation_tokens", ())] == 6
    drafts = [[(c.num_draft_tokens, c.num_accepted_tokens) for c in s.scheduled] for s in engine.trace.steps]
    assert drafts == [[(0, 0)], [(2, 1)], [(0, 0)], [(1, 1)]]
    sd = engine.stats.spec_decoding
    assert (sd.acceptance_rate, sd.mean_acceptance_length) == (2 / 3, 2.0)
    line = LoggingStatLogger(1.0, 0.0).maybe_log(10.0, engine.stats, engine.scheduler_stats())
    assert line.endswith("Draft acceptance rate: 66.7%, Mean acceptance length: 2.00")
    # The figure draws these counts: accepted under rejected, bonus as dots.
    counts = viz.spec_decode_counts(engine.trace)
    assert counts == {"steps": [0, 1, 2, 3], "proposed": [0, 2, 0, 1], "accepted": [0, 1, 0, 1],
                      "bonus": [0, 0, 0, 1]}
    ax = viz.plot_spec_decode(engine.trace).axes[0]
    accepted, rejected = ([p.get_height() for p in bars] for bars in ax.containers)
    assert (accepted, rejected) == ([0, 1, 0, 1], [0, 1, 0, 0])
    dots = next(c for c in ax.collections if c.get_gid() == "bonus").get_offsets().tolist()
    assert dots == [[3, 1]]  # a dot only where a request got a bonus token
    assert ax.get_ylim()[1] > 2  # room above the tallest bar


# -- how many drafts pay: AdaptiveDraftLength and disable_by_batch_size ----------------
class CostedRunner(ScriptedRunner):
    """A scripted target whose step "costs" ``a + b * tokens scored`` model seconds, so
    that the draft length the engine chooses can be worked out without a real clock."""

    def __init__(self, script: list[int], a: float, b: float) -> None:
        super().__init__(script)
        self.a, self.b = a, b

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        out = super().execute_model(scheduler_output)
        return ModelRunnerOutput(out.sampled, self.a + self.b * scheduler_output.num_scheduled_tokens)


def run_costed(a: float, b: float, **spec) -> tuple[list[list[int]], list]:
    """Eight requests (30 to 100 tokens, so they finish one by one) over a script of
    random tokens from a 4-token vocabulary: the proposer nearly always finds a match,
    and roughly a third of its drafts are right."""
    rng = random.Random(0)
    script = [5 + rng.randrange(4) for _ in range(200)]  # 5..8: clear of the end-of-sequence id
    config = EngineConfig(model="tiny", log_stats_interval=None, speculative_config={
        "num_speculative_tokens": 4, "prompt_lookup_max": 2, "adaptive": True, **spec})
    engine = LLMEngine(config, make_tiny_model("llama", vocab_size=16), None,
                       model_runner=CostedRunner(script, a, b))
    for i in range(8):
        engine.add_request(str(i), {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5 + i % 4]},
                           SamplingParams(temperature=0.0, max_tokens=30 + 10 * i))
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0].token_ids
    assert all_blocks_free(SimpleNamespace(llm_engine=engine))
    return [outputs[str(i)] for i in range(8)], list(engine.trace.steps)


def drafts_per_step(steps) -> list[int]:
    return [max((c.num_draft_tokens for c in s.scheduled), default=0) for s in steps]


def test_adaptive_draft_length_follows_the_measured_cost():
    """Where a step costs the same whatever it scores, verifying drafts only adds tokens,
    and the engine keeps all k. Where each scored token costs as much as the step's fixed
    part, drafts right about a third of the time are a loss: after trying each length
    once it verifies none, but for a re-measuring step now and then. The tokens are the
    same either way (and the same as with a fixed k)."""
    flat_tokens, flat = run_costed(a=0.01, b=0.0)
    steep_tokens, steep = run_costed(a=0.01, b=0.01)
    fixed_tokens, _ = run_costed(a=0.01, b=0.01, adaptive=False)
    assert flat_tokens == steep_tokens == fixed_tokens
    flat_drafts, steep_drafts = drafts_per_step(flat), drafts_per_step(steep)
    # (A step's count is its longest draft: the proposer may find fewer than the length.)
    assert max(flat_drafts) == 4 and sum(d > 0 for d in flat_drafts) > 0.8 * len(flat_drafts)
    # Step 0 is the prompts; steps 1-3 try up to 4, 2 and 0 drafts; then 0 wins. Each
    # smaller band of batch sizes, reached as requests finish, is tried the same way.
    assert steep_drafts[1] > 0 and steep_drafts[2] > 0 and steep_drafts[3] == 0
    bands = {band(s.num_running) for s in steep[:-1]}
    tries = 3 * len(bands) + len(steep) // EXPLORE_EVERY  # a noisy first try may win once
    assert len(steep) > 40 and sum(d > 0 for d in steep_drafts) <= tries < len(steep) // 3


def test_adaptive_draft_length_keeps_the_fastest_per_batch_size():
    """The bandit by hand: per band of batch sizes it tries each length once (longest
    first), then keeps the one with the most tokens per second, re-trying the length
    measured longest ago every EXPLORE_EVERY-th step. Bands do not share measurements."""
    policy = AdaptiveDraftLength(8)
    assert policy.lengths == [8, 4, 0]
    rates = {(1, 8): 20.0, (1, 4): 15.0, (1, 0): 10.0,      # one request: long drafts pay
             (32, 8): 60.0, (32, 4): 80.0, (32, 0): 100.0}  # 32 at once: none pay
    chosen = {1: [], 32: []}
    for _ in range(40):
        for batch in (1, 32):
            k = policy.choose(batch)
            chosen[batch].append(k)
            policy.observe_step(int(rates[(batch, k)]), 1.0, decode_only=True)
    assert chosen[1][:3] == chosen[32][:3] == [8, 4, 0]
    assert policy.best_lengths() == {band(1): 8, band(32): 0}
    for batch, best in ((1, 8), (32, 0)):
        rest = chosen[batch][3:]
        explored = [i for i, k in enumerate(rest, start=4) if k != best]
        assert explored and all(i % EXPLORE_EVERY == 0 for i in explored)
    # A step with a prompt chunk measures nothing; neither does a new band until tried.
    policy.choose(32)
    policy.observe_step(1, 1.0, decode_only=False)
    assert policy.best_lengths()[band(32)] == 0
    assert policy.choose(5) == 8 and band(5) not in policy.best_lengths()


def test_disable_by_batch_size_turns_drafts_off_while_many_run():
    """vLLM's switch: no drafts are verified in a step that follows one with more than
    ``disable_by_batch_size`` requests running; drafts come back as requests finish."""
    tokens, steps = run_costed(a=0.01, b=0.0, disable_by_batch_size=3)
    reference, _ = run_costed(a=0.01, b=0.0, adaptive=False)
    assert tokens == reference
    drafts = drafts_per_step(steps)
    assert any(s.num_running > 3 for s in steps) and any(drafts)
    for before, d in zip(steps, drafts[1:]):
        if d:
            assert before.num_running <= 3


# -- the proposer and the configuration ------------------------------------------------
@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),        # suffix "1 2" occurred at the start
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, [7, 2]),  # "2 3" occurred twice: the most recent wins
    ([5, 1, 2, 8, 9, 1, 2], 1, [8]),           # a 2-gram beats the later 1-gram "2"
    ([1, 2, 3], 4, []),                        # the last token never occurred before
    ([4, 4], 3, [4]),                          # a continuation may be shorter than k
])
def test_ngram_proposer(tokens, k, expected):
    assert NgramProposer(k, prompt_lookup_max=4, prompt_lookup_min=1).propose(tokens) == expected


def test_ngram_proposer_minimum_and_cap():
    tokens = [1, 2, 3, 7, 3]  # only the 1-gram "3" matches
    assert NgramProposer(2, 4, 1).propose(tokens) == [7, 3]
    assert NgramProposer(2, 4, 2).propose(tokens) == []
    assert NgramProposer(2, 4, 1).propose(tokens, max_drafts=1) == [7]
    assert NgramProposer(2, 4, 1).propose(tokens, max_drafts=0) == []


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'ngram'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_mx": 3}, "unknown keys"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ("ngram", "must be a dict"),
    ({"num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(speculative_config=value)


def test_speculative_config_flag_takes_json():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, ["speculative_config"])
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineConfig(**engine_kwargs(args))
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                         "adaptive": False, "disable_by_batch_size": None}
