"""Log-probabilities (issue 20): ``logprobs`` and ``prompt_logprobs``, offline and served.

The reference nobody here wrote: transformers' own forward pass of prompt + output
(teacher forcing) on the same model, and ``torch.log_softmax`` of its logits. Every value
the engine returns (the chosen token's logprob and rank, the top-k ids and values, every
prompt token's) must be that reference's, whatever the batch, the chunking, the prefix
cache or speculative decoding did, and whatever temperature or penalty the request
sampled with (vLLM's default ``logprobs_mode="raw_logprobs"``: the model's raw output).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.exceptions import ValidationError
from minivllm.sample.logprobs import MAX_LOGPROBS, Logprob
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 128
TOL = dict(rtol=0, atol=2e-4)
"""Float32 on both sides; the engine's paged attention sums in another order."""


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, log_stats_interval=None)


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(prompt) + len(output), vocab]``: transformers' log-softmax at every position
    of the whole sequence (row ``i`` predicts token ``i + 1``)."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0]
    finally:
        model.set_attn_implementation(saved)
    return logits.float().log_softmax(-1)


def check_position(entry: dict[int, Logprob], ref_row: torch.Tensor, token: int, k: int) -> None:
    """One position's dict against one reference row: the chosen token first, with its
    logprob and rank; then the k most likely tokens with theirs."""
    assert all(isinstance(v, Logprob) for v in entry.values())
    ids = list(entry)
    assert ids[0] == token, "the chosen token comes first"
    chosen = entry[token]
    torch.testing.assert_close(chosen.logprob, ref_row[token].item(), **TOL)
    # Its rank counts the tokens at least as likely (vLLM's rule), up to float noise.
    low = int((ref_row > ref_row[token] + 1e-4).sum()) + 1
    high = int((ref_row >= ref_row[token] - 1e-4).sum())
    assert low <= chosen.rank <= high
    # The top k follow; the chosen token, when it is one of them, is there only once.
    assert len(entry) in (k, k + 1) and (len(entry) == k) == (chosen.rank <= k)
    top = dict(entry) if len(entry) == k else {t: p for t, p in entry.items() if t != token}
    assert sorted(p.rank for p in top.values()) == list(range(1, k + 1))
    top_values = ref_row.topk(k).values if k else []
    for t, p in top.items():
        # By value, not by id: near-ties may swap two ids between the two computations.
        torch.testing.assert_close(p.logprob, top_values[p.rank - 1].item(), **TOL)
        torch.testing.assert_close(p.logprob, ref_row[t].item(), **TOL)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(n)]


# -- parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.0, "3"])
def test_bad_counts_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_default_is_off_and_the_limits_are_accepted():
    p = SamplingParams()
    assert p.logprobs is None and p.prompt_logprobs is None
    assert SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS


# -- values against transformers -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["greedy", "random", "penalized"])
def test_logprobs_are_log_softmax_of_transformers_logits(model, llm, kind):
    """Chosen token and top-k per position equal transformers' log-softmax, for greedy,
    random (temperature 0.8) and penalized requests alike: the raw model output."""
    extra = {"greedy": dict(temperature=0.0),
             "random": dict(temperature=0.8, seed=7),
             "penalized": dict(temperature=0.7, seed=3, repetition_penalty=1.5,
                               logit_bias={5: 3.0}, presence_penalty=0.5)}[kind]
    ps = prompts(6, seed=1)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k, prompt_logprobs=k, **extra)
              for k in (0, 1, 3, 5, 20, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for prompt, p, out in zip(ps, params, outs):
        c = out.outputs[0]
        ref = reference(model, prompt, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 12
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(entry, ref[len(prompt) - 1 + j], token, p.logprobs)
            if kind == "greedy":
                assert entry[token].rank == 1
        torch.testing.assert_close(c.cumulative_logprob,
                                   sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            check_position(out.prompt_logprobs[i], ref[i - 1], prompt[i], p.prompt_logprobs)


def test_requests_without_logprobs_are_untouched(llm):
    """In a batch with logprobs requests, one that asks for none gets the same tokens as
    alone, and None in every logprobs field."""
    ps = prompts(4, seed=2)
    plain = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ps[0]}, plain, use_tqdm=False)[0]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        [plain] + [SamplingParams(temperature=0.9, seed=s, max_tokens=10, ignore_eos=True,
                                  logprobs=4, prompt_logprobs=2) for s in range(3)],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for out in (alone, mixed[0]):
        assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
        assert out.prompt_logprobs is None
    assert all(len(o.outputs[0].logprobs) == 10 for o in mixed[1:])


def test_seeded_tokens_do_not_change_when_logprobs_are_asked(llm):
    ps = prompts(3, seed=4)
    base = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": p} for p in ps],
                     [SamplingParams(seed=i, **base) for i in range(3)], use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": p} for p in ps],
                     [SamplingParams(seed=i, logprobs=3, **base) for i in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


# -- prompt logprobs across chunks, the prefix cache and preemption ----------------------------
def prompt_values(out) -> list[list[tuple[int, float, int]]]:
    return [[(t, p.logprob, p.rank) for t, p in e.items()] for e in out.prompt_logprobs[1:]]


def close(a: list, b: list) -> bool:
    return all(len(x) == len(y) and all(s[0] == t[0] and abs(s[1] - t[1]) < 2e-4 for s, t in zip(x, y))
               for x, y in zip(a, b)) and len(a) == len(b)


def test_chunked_prefill_gives_the_same_prompt_logprobs(model, llm):
    """A prompt run in chunks of 8 tokens (with other requests in the same steps) gives
    every prompt position's logprobs, equal to the whole prompt's run at once."""
    ps = [p * 3 for p in prompts(4, seed=5)]  # 6..120 tokens: several chunks each
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k,
                             logprobs=1) for k in (0, 3, 5, 2)]
    whole = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    chunked_llm = LLM(model, max_num_batched_tokens=8, log_stats_interval=None)
    chunked = chunked_llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert any(s.is_prefill and s.num_computed_tokens > 0
               for step in chunked_llm.trace.steps for s in step.scheduled), "no prompt was chunked"
    for p, a, b in zip(ps, whole, chunked):
        assert len(b.prompt_logprobs) == len(p)
        assert close(prompt_values(a), prompt_values(b))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ref = reference(model, p, [])
        for i in range(1, len(p)):
            torch.testing.assert_close(b.prompt_logprobs[i][p[i]].logprob, ref[i - 1, p[i]].item(), **TOL)


def test_prompt_logprobs_requests_take_no_prefix_cache_hits(model):
    llm = LLM(model, log_stats_interval=None)
    prompt = {"prompt_token_ids": prompts(1, seed=6)[0] * 4}
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                         use_tqdm=False)[0]
    again = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                         use_tqdm=False)[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0, "the prompt's blocks are cached"
    assert again.num_cached_tokens == 0
    assert close(prompt_values(first), prompt_values(again))


def test_preempted_requests_score_each_prompt_token_once(model):
    """With too few KV blocks requests are preempted and recomputed; each prompt token is
    still scored once, and the outputs' logprobs match transformers'."""
    llm = LLM(model, num_kv_blocks=10, max_num_batched_tokens=64, log_stats_interval=None)
    ps = prompts(6, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert any(step.preempted for step in llm.trace.steps), "nothing was preempted"
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        ref = reference(model, p, c.token_ids)
        assert len(out.prompt_logprobs) == len(p) and len(c.logprobs) == 30
        for i in range(1, len(p)):
            check_position(out.prompt_logprobs[i], ref[i - 1], p[i], 2)
        for j, (t, e) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(e, ref[len(p) - 1 + j], t, 2)


# -- speculative decoding ---------------------------------------------------------------------
def test_accepted_drafts_get_their_own_positions_logprobs(model):
    """With n-gram drafts, several tokens arrive in one step; each one's logprobs are those
    of its own position, as transformers scores the final sequence."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(model, speculative_config=spec, log_stats_interval=None)
    rng = random.Random(9)
    ps = [([rng.randrange(VOCAB) for _ in range(5)] * 6)[:rng.randint(12, 30)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert any(s.num_accepted_tokens > 0 for step in llm.trace.steps for s in step.scheduled), \
        "no draft was accepted: the test proves nothing"
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        ref = reference(model, p, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for j, (t, e) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(e, ref[len(p) - 1 + j], t, 3)
            assert e[t].rank == 1


def test_stop_token_among_drafts_keeps_logprobs_aligned(model):
    """Tokens after a stop are dropped, and so are their entries."""
    llm = LLM(model, log_stats_interval=None)
    p = prompts(1, seed=10)[0]
    full = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=10,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = full[4]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop], logprobs=1),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(stop) + 1]
    assert len(out.logprobs) == len(out.token_ids)


# -- through the server, engine core in its own process ----------------------------------------
@pytest.mark.real_model
@pytest.mark.multiprocess
def test_openai_client_completions_and_chat_logprobs_stream_and_not():
    """The official client, both endpoints, streamed and not, against the offline engine
    on the same model: the same tokens, logprobs and top alternatives."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from minivllm.entrypoints.openai.api_server import ServerThread, build_app

    offline = LLM(log_stats_interval=None)
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "Name a colour."}]
    k = 3
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=k)
    ref_c = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    ref_chat = offline.generate({"prompt_token_ids": offline._chat_ids(messages)}, params,
                                use_tqdm=False)[0].outputs[0]
    del offline

    def chosen(entry):
        return next(iter(entry.values()))

    app = build_app(api_key="k", log_stats_interval=None)  # the engine core in its own process
    with ServerThread(app) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k")
        model = client.models.list().data[0].id

        # completions, then the same streamed
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      logprobs=k)
        lp = r.choices[0].logprobs
        assert lp.tokens == [chosen(e).decoded_token for e in ref_c.logprobs]
        assert "".join(lp.tokens) == r.choices[0].text == ref_c.text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        for got, got_top, e in zip(lp.token_logprobs, lp.top_logprobs, ref_c.logprobs):
            assert got == pytest.approx(chosen(e).logprob, abs=1e-4)
            assert got_top == pytest.approx({p.decoded_token: p.logprob for p in e.values()}, abs=1e-4)
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                temperature=0, logprobs=k, stream=True))
        streamed = [c.choices[0].logprobs for c in chunks if c.choices]
        assert sum((c.tokens for c in streamed), []) == lp.tokens
        assert sum((c.text_offset for c in streamed), []) == lp.text_offset
        assert sum((c.token_logprobs for c in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-4)

        # chat, then the same streamed
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=k)
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == [chosen(e).decoded_token for e in ref_chat.logprobs]
        for c, e in zip(content, ref_chat.logprobs):
            assert c.logprob == pytest.approx(chosen(e).logprob, abs=1e-4)
            assert c.bytes == list(c.token.encode())
            top = sorted(e.values(), key=lambda p: p.rank)[:k]
            assert [t.token for t in c.top_logprobs] == [p.decoded_token for p in top]
            assert [t.logprob for t in c.top_logprobs] == pytest.approx([p.logprob for p in top], abs=1e-4)
            assert c.top_logprobs[0].logprob >= c.logprob - 1e-6
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=k, stream=True))
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
        assert [t.token for t in streamed] == [c.token for c in content]
        assert [t.logprob for t in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)

        # off unless asked; refused with a 400 naming the field when out of range
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert r.choices[0].logprobs is None
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model=model, prompt=prompt, max_tokens=2, logprobs=MAX_LOGPROBS + 1)


def test_each_of_n_completions_has_its_own_logprobs(model, llm):
    """With n > 1 every completion carries the logprobs of its own tokens, and the parent's
    output the prompt's (the same prompt for every child)."""
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded children should differ"
    for c in out.outputs:
        ref = reference(model, prompt, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(entry, ref[len(prompt) - 1 + i], token, 2)
    ref = reference(model, prompt, [])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        torch.testing.assert_close(out.prompt_logprobs[j][prompt[j]].logprob, ref[j - 1, prompt[j]].item(), **TOL)
