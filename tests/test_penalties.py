"""Penalties, min_p and logit_bias (issue 20): vLLM's semantics, per request, batched.

References nobody here wrote or that are written out plainly here, one request at a time:
a per-row loop over small logits for the batched tensor code; transformers' generate()
with ``repetition_penalty`` for the engine's greedy tokens; the model's own forward pass
with the penalties applied by hand, token by token, for all of them together. Requests
that ask for none of this get exactly the tokens they get without a penalized neighbour.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch
from helpers import all_blocks_free, greedy
from tiny_chat import tiny_chat_llm
from transformers import GenerationConfig

from minivllm import LLM, SamplingParams
from minivllm.exceptions import ValidationError
from minivllm.metrics import Counter
from minivllm.sample.sampler import Sampler, apply_logits_processors, apply_min_p, target_probs
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


# -- the batched processors against a plain per-request loop ---------------------------------
def reference_row(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
                  ) -> torch.Tensor:
    """vLLM's order, one request, one token at a time: bias, repetition (prompt and
    output), then frequency and presence (output only)."""
    row = row.clone()
    for token, bias in p.logit_bias.items():
        row[token] += bias
    for token in set(prompt) | set(output):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["none", "rep", "pres_freq", "bias", "all"])
    kw: dict = {}
    if kind in ("rep", "all"):
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if kind in ("pres_freq", "all"):
        kw["presence_penalty"] = rng.uniform(-2, 2)
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if kind in ("bias", "all"):
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}
    return SamplingParams(temperature=rng.choice([0.0, 1.0]), **kw)


@pytest.mark.parametrize("seed", range(20))
def test_batched_processors_equal_a_per_request_loop(seed):
    rng = random.Random(seed)
    vocab, n = 24, 7
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = [random_params(rng, vocab) for _ in range(n)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(n)]
    got = apply_logits_processors(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        want = reference_row(logits[i], p, prompts[i], outputs[i])
        if not p.has_penalties and not p.logit_bias:
            assert torch.equal(got[i], logits[i]), f"row {i} asks for nothing and was changed"
        else:
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)


def test_the_sign_rule_and_which_tokens_count():
    """Repetition divides a positive logit and multiplies a negative one (both less likely
    for a penalty > 1) and counts the prompt; presence and frequency count only the output."""
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0, 2.0]])
    prompt, output = [0, 1], [3, 3]
    rep = apply_logits_processors(logits, [SamplingParams(repetition_penalty=2.0)], [prompt], [output])
    assert rep.tolist() == [[1.0, -4.0, 2.0, 1.0, 2.0]]
    pres = apply_logits_processors(logits, [SamplingParams(presence_penalty=0.5)], [prompt], [output])
    assert pres.tolist() == [[2.0, -2.0, 2.0, 1.5, 2.0]]
    freq = apply_logits_processors(logits, [SamplingParams(frequency_penalty=0.5)], [prompt], [output])
    assert freq.tolist() == [[2.0, -2.0, 2.0, 1.0, 2.0]]
    bias = apply_logits_processors(logits, [SamplingParams(logit_bias={"4": -100, 2: 1})], [prompt],
                                   [output])
    assert bias.tolist() == [[2.0, -2.0, 3.0, 2.0, -98.0]]


def test_nothing_asked_nothing_done():
    logits = torch.randn(3, 10)
    assert apply_logits_processors(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3) is logits


def test_min_p_keeps_tokens_within_a_fraction_of_the_top_one():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    # min_p 0.19: threshold 0.095 keeps 0.5, 0.3, 0.1; min_p 0.7 keeps only 0.5.
    assert torch.isfinite(apply_min_p(logits, 0.19)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(apply_min_p(logits, 0.7)).tolist() == [True, False, False, False, False]
    # After temperature: at T = 2 the distribution is flatter (0.35 ... 0.10), and min_p
    # 0.3 (a cut at 0.105) keeps four tokens where at T = 1 it keeps two.
    assert torch.isfinite(apply_min_p(logits, 0.3)).sum() == 2
    p = SamplingParams(temperature=2.0, min_p=0.3)
    kept = target_probs(logits, p) > 0
    flat = (logits / 2).softmax(-1)
    assert kept.tolist() == (flat >= 0.3 * flat.max()).tolist() == [True, True, True, True, False]
    # Renormalized over what is kept.
    torch.testing.assert_close(target_probs(logits, p)[kept], flat[kept] / flat[kept].sum())


def test_min_p_does_not_change_greedy():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    assert Sampler()(logits, [SamplingParams(temperature=0.0, min_p=0.99)], [None]) == [1]


# -- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "1"),
    ("frequency_penalty", 3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", True),
    ("min_p", -0.1), ("min_p", 1.5),
    ("logit_bias", {1: 101}), ("logit_bias", {1: -100.5}), ("logit_bias", {"x": 1}),
    ("logit_bias", {-1: 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {1.5: 1}),
    ("logit_bias", {1: "5"}), ("logit_bias", [1, 2]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_limits_are_inclusive_and_keys_may_be_strings():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, min_p=1, repetition_penalty=1e-3,
                       logit_bias={"7": 100, 8: -100})
    assert p.logit_bias == {7: 100.0, 8: -100.0}


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama", vocab_size=VOCAB)


@contextmanager
def stock(model):
    """The model as transformers runs it: its own attention, no generation defaults."""
    saved = model.config._attn_implementation, model.generation_config
    model.set_attn_implementation("sdpa")
    model.generation_config = GenerationConfig()
    try:
        yield model
    finally:
        model.set_attn_implementation(saved[0])
        model.generation_config = saved[1]


def hf_greedy_repetition(model, prompt: list[int], n: int, penalty: float) -> list[int]:
    """transformers' generate(), greedy, with its RepetitionPenaltyLogitsProcessor."""
    with stock(model):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=GenerationConfig(
                                 max_new_tokens=n, do_sample=False, repetition_penalty=penalty,
                                 eos_token_id=None, pad_token_id=0))
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hand_greedy(model, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """The model's full forward pass each token (no cache), the penalties by hand."""
    ids, out = list(prompt), []
    with stock(model):
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(reference_row(row, p, prompt, out).argmax())
            ids.append(token)
            out.append(token)
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_repetition_penalty_matches_transformers(tiny):
    ps = prompts(4)
    llm = LLM(tiny, log_stats_interval=None, max_num_batched_tokens=32)  # chunked prompts too
    for penalty in (1.5, 0.7):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=penalty)
        refs = [hf_greedy_repetition(tiny, p, 20, penalty) for p in ps]
        assert run(llm, ps, [params] * len(ps)) == refs
        assert refs != run(llm, ps, [greedy(20)] * len(ps)), "the penalty changed nothing here"
    assert all_blocks_free(llm)


def test_every_processor_matches_the_hand_reference_and_leaves_neighbours_alone(tiny):
    ps = prompts(6, seed=1)
    n = 16
    asks = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, frequency_penalty=0.8,
                       repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logit_bias={5: 100, 9: -3}),
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=-0.5,
                       frequency_penalty=0.3, repetition_penalty=0.9, logit_bias={"11": 2.5}, min_p=0.5),
    ]
    llm = LLM(tiny, log_stats_interval=None, num_kv_blocks=24, block_size=4)  # preemption too
    plain = run(llm, ps[4:], [greedy(n)] * 2)
    mixed = run(llm, ps, asks + [greedy(n)] * 2)
    assert mixed[4:] == plain, "a request without penalties changed because a neighbour has them"
    for p, params, got in zip(ps, asks, mixed):
        assert got == hand_greedy(tiny, p, n, params)
    assert mixed[2] == [5] * n, "a +100 bias forces its token"
    assert sum(len(s.preempted) for s in llm.trace.steps) > 0
    assert all_blocks_free(llm)


def test_seeded_sampling_with_penalties_is_reproducible_whatever_the_batch(tiny):
    ps = prompts(5, seed=2)
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=11, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05, top_k=50,
                            logit_bias={3: 4.0})
    llm = LLM(tiny, log_stats_interval=None)
    alone = run(llm, ps[:1], [seeded])[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, presence_penalty=2)] * 2
    assert run(llm, ps[:3], [seeded, *others])[0] == alone
    assert run(llm, ps[:1], [seeded])[0] == alone
    unpenalized = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=11)
    assert run(llm, ps[:1], [unpenalized])[0] != alone


def copying_prompts(n: int, seed: int) -> list[list[int]]:
    """Repeated phrases, so the n-gram proposer has drafts to offer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]
        out.append((phrase * 10)[: rng.randint(20, 60)])
    return out


def test_speculation_scores_drafts_with_the_same_penalties(tiny):
    """Each draft row is penalized as if the drafts before it had been generated (vLLM's
    rejection sampler does the same), so greedy output with speculation is token for token
    the output without it, and drafts still get accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    ps = copying_prompts(6, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in (
        dict(repetition_penalty=1.1), dict(presence_penalty=0.2, frequency_penalty=0.1),
        dict(logit_bias={7: 1.0}), dict(repetition_penalty=0.8), {}, {})]
    with_spec = LLM(tiny, log_stats_interval=None, speculative_config=spec)
    without = LLM(tiny, log_stats_interval=None)
    got = run(with_spec, ps, params)
    assert got == run(without, ps, params)
    assert got[:4] == [hand_greedy(tiny, p, 24, q) for p, q in zip(ps[:4], params[:4])]
    counts = {m.name: m.value for m in with_spec.get_metrics()
              if isinstance(m, Counter) and m.name.startswith("minivllm:spec_decode") and not m.labels}
    assert counts["minivllm:spec_decode_num_accepted_tokens"] > 0
    assert all_blocks_free(with_spec)


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 1e30, 1.7976931348623157e308])
def test_extreme_repetition_penalties_sample_instead_of_failing(tiny, penalty):
    """Any penalty > 0 is allowed (vLLM's rule); the schema fuzzer found that 5e-324 made
    NaN logits (it is 0 in float32). Now a seen token is merely certain or impossible."""
    llm = LLM(tiny, log_stats_interval=None)
    params = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=1, repetition_penalty=penalty)
              for t in (0.0, 1e-5, 0.5, 1e6)]
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 2, 1]}] * 4, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4, [o.outputs[0].error for o in outs]


def test_logit_bias_token_outside_the_vocabulary_is_refused(tiny):
    llm = LLM(tiny, log_stats_interval=None)
    with pytest.raises(ValidationError) as info:
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"


# -- the server, with the official client --------------------------------------------------------
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served():
    """(OpenAI client, offline references computed before the server owns the engine)."""
    from minivllm.entrypoints.openai.api_server import ServerThread, build_app

    llm = tiny_chat_llm(max_model_len=256)
    chat = [{"role": "user", "content": "Tell me a story."}]
    penalized = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.4, frequency_penalty=0.5,
                               min_p=0.1, ignore_eos=True)
    ref = llm.generate({"prompt_token_ids": llm._chat_ids(chat)}, penalized, use_tqdm=False)[0].outputs[0]
    with ServerThread(build_app(llm)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60), {"chat": (chat, ref)}


def completion_ids(client, **kw) -> list[int]:
    r = client.completions.create(model=None, prompt="Once upon a time", temperature=0, extra_body={
        "return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}, **kw)
    return r.choices[0].token_ids


def test_server_logit_bias_moves_the_greedy_token(served):
    client, _ = served
    first = completion_ids(client, max_tokens=1)[0]
    banned = completion_ids(client, max_tokens=1, logit_bias={str(first): -100})[0]
    assert banned != first
    assert completion_ids(client, max_tokens=3, logit_bias={"42": 100}) == [42, 42, 42]


def test_server_presence_penalty_breaks_a_loop(served):
    """A small bias on one token makes the tiny model say it forever; a presence penalty
    larger than the bias lets it be said once."""
    client, _ = served
    loop = completion_ids(client, max_tokens=24, logit_bias={"42": 1.5})
    assert loop == [42] * 24
    penalized = completion_ids(client, max_tokens=24, logit_bias={"42": 1.5}, presence_penalty=2.0)
    assert penalized[0] == 42 and penalized.count(42) == 1, penalized


def test_server_chat_honours_the_vllm_fields(served):
    client, refs = served
    chat, ref = refs["chat"]
    r = client.chat.completions.create(
        model=None, messages=chat, temperature=0, max_tokens=12, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.4, "min_p": 0.1, "ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == ref.token_ids


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("repetition_penalty", 0),
                                         ("min_p", 1.5), ("logit_bias", {"1": 200}),
                                         ("logit_bias", {"x": 1}), ("logit_bias", {str(10**7): 1})])
def test_server_refuses_out_of_range_values_naming_the_field(served, field, value):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt="hi", max_tokens=2, extra_body={field: value})
    assert info.value.body["param"] == field, info.value.body
