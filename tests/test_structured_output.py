"""Structured output (issue 20): a grammar's mask on the logits, offline and through the server.

The model is the tiny random Llama over SmolLM2's real tokenizer: its tokens are garbage,
so the mask does all the work, and any output that parses proves the mask, not the
model. References nobody here wrote: ``json.loads`` and ``jsonschema`` for JSON,
``re.fullmatch`` for regexes, the tokenizer's own strings for which tokens may start a
choice, and the engine's outputs without the guided requests for their neighbours.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from helpers import all_blocks_free
from tiny_chat import tiny_chat_llm

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.exceptions import ValidationError
from minivllm.sample.sampler import apply_logits_processors
from minivllm.worker.model_loader import make_tiny_model

pytest.importorskip("xgrammar")  # the "structured" extra; `make test` installs it (dev)

SCHEMA = {
    "type": "object",
    "properties": {
        # A bounded string as a pattern, not maxLength: see the xfail test below.
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "not sure"]
REGEX = r"[a-z]{2,6}-\d{3}"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_chat_llm()


def guided(seed: int, max_tokens: int = 64, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def texts(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# -- the engine's outputs obey the grammar ----------------------------------------------
def test_100_seeded_samples_follow_a_json_schema(llm):
    params = [guided(i, json=SCHEMA, disable_any_whitespace=True) for i in range(100)]
    outs = texts(llm, [f"Describe person {i} as JSON." for i in range(100)], params)
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids[-1] == llm.llm_engine.eos_token_id  # the grammar ended it
    assert len({o.text for o in outs}) > 50, "seeded samples should differ"
    assert all_blocks_free(llm)


def test_json_object_and_a_schema_given_as_text(llm):
    """Any JSON object: the random model alone would fill a key with garbage until
    max_tokens, so a logit_bias towards quotes and braces (applied before the mask, and
    composing with it) lets it close them."""
    tokenizer = llm.llm_engine.tokenizer
    bias = {tokenizer.convert_tokens_to_ids(t): 12.0 for t in ('"', "}", '"}')}
    json_object = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, logit_bias=bias,
                                  structured_outputs=StructuredOutputsParams(json_object=True,
                                                                       disable_any_whitespace=True))
                   for i in range(5)]
    outs = texts(llm, ["JSON please"] * 10, json_object
                 + [guided(i, json=json.dumps(SCHEMA), disable_any_whitespace=True)
                    for i in range(5)])
    for out in outs[:5]:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out
    for out in outs[5:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_choice_list_yields_only_its_choices(llm):
    outs = texts(llm, ["Answer:"] * 40, [guided(i, choice=CHOICES) for i in range(40)])
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1, "a random model should pick more than one choice"


def test_a_regex_yields_only_matches(llm):
    outs = texts(llm, ["Code:"] * 40, [guided(i, regex=REGEX) for i in range(40)])
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


def test_each_child_of_n_gets_its_own_grammar_state(llm):
    """n > 1 fans out into child requests, each added on its own: each has its own matcher
    (a shared one would advance over every child's tokens)."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=64, n=4,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                 disable_any_whitespace=True))
    out = llm.generate("JSON:", params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_greedy_and_ignore_eos_still_stop_when_the_grammar_is_complete(llm):
    """Greedy takes the argmax of the masked logits; with ignore_eos the request still
    ends when the grammar has accepted the end of sequence: nothing valid is left."""
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=CHOICES))]
    out = texts(llm, ["Answer:"], params)[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_requests_without_a_grammar_are_unaffected(llm):
    """Unguided requests (greedy, seeded, penalized) sharing steps with guided ones get
    exactly their tokens of a run without the guided ones."""
    plain_prompts = [f"Tell me about {w}" for w in ("cats", "rivers", "trains", "salt")]
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=8, top_k=50, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)]
    alone = [o.token_ids for o in texts(llm, plain_prompts, plain)]
    mixed_prompts, mixed = [], []
    for i, (p, sp) in enumerate(zip(plain_prompts, plain)):
        mixed_prompts += [p, "JSON:"]
        mixed += [sp, guided(i, json=SCHEMA, disable_any_whitespace=True)]
    outs = texts(llm, mixed_prompts, mixed)
    assert [o.token_ids for o in outs[0::2]] == alone
    for o in outs[1::2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


# -- the mask itself, against the tokenizer's own strings -----------------------------------
def test_the_first_mask_of_a_choice_allows_exactly_the_prefixes(llm):
    """At the first step of choice ["yes", "no", "not sure"], a token is allowed exactly
    when its text is a non-empty prefix of a choice; the row without a grammar is
    returned unchanged, and allowed tokens keep their logits."""
    engine = llm.llm_engine
    tokenizer, vocab = engine.tokenizer, engine.model.config.vocab_size
    engine.add_request("mask", "Answer:", guided(0, choice=CHOICES))
    state = engine.scheduler.requests["mask"].grammar
    engine.abort_request("mask")
    engine.step()  # hands out the abort's output
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    got = apply_logits_processors(logits, [], [], [], grammars=[None, state])
    assert torch.equal(got[0], logits[0])
    allowed = {t for t in range(len(tokenizer))
               if (s := tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)]))
               and any(c.startswith(s) for c in CHOICES)
               and t not in tokenizer.all_special_ids}
    kept = set(torch.isfinite(got[1]).nonzero().flatten().tolist())
    assert kept == allowed, (sorted(kept - allowed)[:10], sorted(allowed - kept)[:10])
    assert torch.equal(got[1][sorted(kept)], logits[1][sorted(kept)])
    assert all_blocks_free(llm)


@pytest.mark.xfail(strict=True, reason="xgrammar 0.2.9 bug (mlc-ai/xgrammar#800, fix proposed "
                   "in #880): a string with minLength/maxLength admits raw control characters, "
                   "which JSON forbids; a pattern or an unbounded string is safe")
def test_a_length_bounded_string_refuses_a_raw_tab(llm):
    engine = llm.llm_engine
    engine.add_request("tab", "JSON:", guided(0, json={"type": "string", "maxLength": 8}))
    state = engine.scheduler.requests["tab"].grammar
    engine.abort_request("tab")
    engine.step()
    accepted = [state.accept_token(t) for t in engine.tokenizer.encode('"a\tb"')]
    assert not all(accepted), "the grammar accepted a raw tab inside a JSON string"


# -- preemption and speculative decoding ----------------------------------------------------
def run_seeded(model, tokenizer, **config) -> tuple[LLM, list]:
    llm = LLM(model, tokenizer=tokenizer, log_stats_interval=None, **config)
    params = [guided(i, 80, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    outs = texts(llm, [f"Person {i}: " + "name and age " * 4 for i in range(8)], params)
    return llm, outs


def test_preemption_keeps_the_grammar_state(llm):
    """A preempted request keeps its output tokens and so its matcher's place: after the
    recompute it goes on where it stopped, token-identical to a run without preemption."""
    model, tokenizer = llm.llm_engine.model, llm.llm_engine.tokenizer
    _, ample = run_seeded(model, tokenizer)
    pressed_llm, pressed = run_seeded(model, tokenizer, num_kv_blocks=10, block_size=8,
                                      max_num_batched_tokens=64)
    assert sum(len(s.preempted) for s in pressed_llm.trace.steps) > 0, "the small cache should preempt"
    assert [o.token_ids for o in pressed] == [o.token_ids for o in ample]
    for out in pressed:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all_blocks_free(pressed_llm)


def test_no_drafts_for_guided_requests_with_speculative_decoding(llm):
    """Guided requests decode one masked token per step (no drafts are proposed for
    them), so their output equals the run without speculative decoding, while an
    unguided request in the same batch still gets drafts."""
    model, tokenizer = llm.llm_engine.model, llm.llm_engine.tokenizer
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1, "adaptive": False}
    _, plain = run_seeded(model, tokenizer)
    spec_llm = LLM(model, tokenizer=tokenizer, log_stats_interval=None, speculative_config=spec)
    copying = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [guided(i, 80, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    outs = spec_llm.generate([f"Person {i}: " + "name and age " * 4 for i in range(8)]
                             + ["a b c a b c a b c a b c"], params + [copying], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:8]] == [o.token_ids for o in plain]
    drafts = {o.request_id: 0 for o in outs}
    for step in spec_llm.trace.steps:
        for c in step.scheduled:
            drafts[c.request_id] += c.num_draft_tokens
    assert [drafts[o.request_id] for o in outs[:8]] == [0] * 8, drafts
    assert drafts[outs[8].request_id] > 0, "the unguided request should get drafts"


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of"),
    (dict(json=SCHEMA, regex="a+"), "got json, regex"),
    (dict(json=[1, 2]), "json must be a JSON schema"),
    (dict(json='{"type": "objectx"}'), "Unsupported type"),
    (dict(json="{not json"), "structured_outputs.json is not valid"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (dict(regex="(ab"), "parenthesis is not closed"),
    (dict(regex=3), "regex must be a string"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(choice=["a", 1]), "non-empty list of strings"),
    (dict(grammar="root ::= "), "structured_outputs.grammar is not valid"),
    (dict(json_object=True, disable_any_whitespace="yes"), "structured_outputs"),
    (dict(regex="a+", disable_any_whitespace=True), "json and json_object only"),
])
def test_invalid_guided_params_raise_validation_error(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs"


def test_structured_outputs_must_be_structured_outputs_params():
    with pytest.raises(ValidationError, match="must be a StructuredOutputsParams") as e:
        SamplingParams(structured_outputs={"json": SCHEMA})
    assert e.value.param == "structured_outputs"


def test_an_engine_without_a_tokenizer_refuses_guided_requests():
    llm = LLM(make_tiny_model("llama"), log_stats_interval=None)
    with pytest.raises(ValidationError, match="needs the engine's tokenizer"):
        llm.llm_engine.add_request("g", {"prompt_token_ids": [1, 2]}, guided(0, choice=CHOICES))
    assert not llm.llm_engine.has_unfinished_requests()


# -- the server: response_format and vLLM's structured_outputs, engine core in its own process --
@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    """The tiny model saved as a Hugging Face folder, served by build_app's default: an
    engine core in a process of its own, so the structured-output params cross the msgpack
    wire."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from minivllm.entrypoints.openai.api_server import ServerThread, build_app

    folder = tmp_path_factory.mktemp("tiny-chat")
    llm.llm_engine.model.save_pretrained(folder)
    llm.llm_engine.tokenizer.save_pretrained(folder)
    app = build_app(model=str(folder), log_stats_interval=None)
    with ServerThread(app) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.1)
        yield s


@pytest.fixture()
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=1.0, max_tokens=64,
        messages=[{"role": "user", "content": "Describe a person as JSON."}], **kwargs)


@pytest.mark.multiprocess
def test_server_response_format_json_schema(client, llm):
    # OpenAI's response_format allows any whitespace, which the random model pours out
    # until max_tokens: it must be the same grammar as the offline engine's json=SCHEMA
    # (same seed, same tokens). Whitespace-free JSON is vLLM's structured_outputs option.
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(3):
        r = chat(client, seed=seed, response_format=fmt)
        offline = llm.chat(messages, SamplingParams(temperature=1.0, max_tokens=64, seed=seed,
                                                    structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                           use_tqdm=False)[0].outputs[0]
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (offline.text, offline.finish_reason)
    for seed in range(5):
        r = chat(client, seed=seed, extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.multiprocess
def test_server_structured_outputs_on_both_endpoints(client):
    r = chat(client, seed=1, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].message.content in CHOICES
    c = client.completions.create(model=client.models.list().data[0].id, prompt="Code:", max_tokens=20,
                                  seed=2, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, c.choices[0].text) and c.choices[0].finish_reason == "stop"


@pytest.mark.multiprocess
@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "structured_outputs", "minimum greater than maximum"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", None),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}}, "structured_outputs",
     "json_object only"),
    ({"structured_outputs": {"json": SCHEMA}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"guided_choice": ["a"]}, "guided_choice", '"structured_outputs": {"choice": [...]}'),
    ({"guided_json": SCHEMA}, "guided_json", "removed from vLLM's API in v0.12"),
    ({"disable_any_whitespace": True}, "disable_any_whitespace", "unknown field"),
])
def test_server_bad_structured_output_requests_are_400_naming_the_field(client, body, param, message):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=body)
    error = e.value.body
    assert error["param"] == param or param in error["message"], error
    if message:
        assert message in error["message"], error
    assert chat(client, seed=3, extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0] \
        .message.content in CHOICES, "the server must still serve after a refusal"


def test_n_children_each_follow_the_grammar_and_a_bad_one_queues_nothing(llm):
    """With n > 1 every child has a matcher of its own (each answer is one of the choices),
    and a grammar that cannot compile is refused before any child is queued."""
    out = llm.generate("Pick one:", SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.text in CHOICES for c in out.outputs), out.outputs
    assert all_blocks_free(llm)


def test_a_grammar_that_fails_to_compile_queues_no_child(llm, monkeypatch):
    """A grammar that parses but cannot be compiled for this tokenizer (simulated: the
    compiler raises) is refused before the first of n children is queued."""
    engine = llm.llm_engine

    def refuse(guided):
        raise ValidationError("structured_outputs", "structured_outputs.regex could not be compiled", guided)

    monkeypatch.setattr(engine, "_new_grammar_state", refuse)
    with pytest.raises(ValidationError, match="could not be compiled"):
        engine.add_request("bad", "x", SamplingParams(n=3, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not engine.has_unfinished_requests() and not engine.has_request("bad")
    assert not any(engine.has_request(f"{i}_bad") for i in range(3))


def test_async_scheduling_gives_the_same_guided_samples(llm):
    """With async scheduling a guided request waits for its token before it runs again
    (its mask needs it): its seeded samples, and its neighbours', are those of the engine
    without it."""
    model, tokenizer = llm.llm_engine.model, llm.llm_engine.tokenizer
    prompts = [f"Describe person {i} as JSON." for i in range(6)]
    params = [guided(i, json=SCHEMA, disable_any_whitespace=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(6)]
    async_llm = LLM(model, tokenizer=tokenizer, log_stats_interval=None, async_scheduling=True)
    outs = texts(async_llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in texts(llm, prompts, params)]
    for out in outs[1::2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all_blocks_free(async_llm)
