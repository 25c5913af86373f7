"""The engine core hands out token ids; one OutputProcessor makes the text (vLLM's split).

An ``EngineCore`` alone is the engine core of ``minivllm serve``: it must never need its
tokenizer, and an ``OutputProcessor`` fed its outputs, telling it
of stop strings one step late as the API server does, must give exactly the outputs of
the in-process engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import all_blocks_free
from tiny_chat import tiny_chat_llm

from minivllm import SamplingParams
from minivllm.engine.core import EngineCore
from minivllm.engine.output_processor import OutputProcessor
from minivllm.metrics import RequestMetrics

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    return tiny_chat_llm(max_model_len=256, max_num_seqs=4)


def core_of(llm) -> EngineCore:
    """An engine core over the same model and tokenizer, making no text."""
    engine = llm.llm_engine
    return EngineCore(engine.config, engine.model, engine.tokenizer)


def params_with_stops(llm) -> list[SamplingParams]:
    """Greedy params per prompt, every other one with a stop string taken from the middle
    of its own greedy text (so it really stops there)."""
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) for _ in PROMPTS]
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    params = []
    for i, text in enumerate(texts):
        stop = text[len(text) // 2: len(text) // 2 + 3] if i % 2 and len(text.strip()) > 8 else None
        params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2,
                                     stop=[stop] if stop and stop.strip() else None))
    assert any(p.stop for p in params), texts
    return params


def test_the_core_never_decodes(llm, monkeypatch):
    core = core_of(llm)
    monkeypatch.setattr(type(core.tokenizer), "decode",
                        lambda *a, **k: pytest.fail("the engine core decoded a token"))
    processor = llm.llm_engine.processor  # the front end tokenizes; the core never decodes
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), processor.process_prompt(prompt),
                         SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, stop=["never"]))
    got: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
    assert all(len(ids) == 6 for ids in got.values()) and len(got) == len(PROMPTS)


def test_processor_one_step_behind_gives_the_in_process_outputs(llm):
    """The API server's case: stop strings reach the core after its next step."""
    params = params_with_stops(llm)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    core = core_of(llm)
    processor = OutputProcessor(core.tokenizer)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        request = core.add_request(str(i), llm.llm_engine.processor.process_prompt(prompt), p)
        processor.add_request(str(i), prompt, request.prompt_token_ids, p.stop, p.min_tokens, True,
                              RequestMetrics(arrival_time=0.0))
    final, late, told = {}, [], 0
    while core.has_unfinished_requests():
        outputs = core.step()
        core.finish_requests(late)  # what the server sent after the previous step
        processed = processor.process_outputs(outputs)
        late = processed.finishes
        told += len(late)
        final.update({o.request_id: o.outputs[0] for o in processed.request_outputs if o.finished})
    core.finish_requests(late)
    assert not processor.has_unfinished_requests()
    for i, want in enumerate(expected):
        got, want = final[str(i)], want.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason)
        # The same tokens and ranks; the values to float tolerance (one step's lag changes
        # which requests share a batch, and so the order of the sums).
        assert [{t: (p.rank, p.decoded_token) for t, p in d.items()} for d in got.logprobs] == \
            [{t: (p.rank, p.decoded_token) for t, p in d.items()} for d in want.logprobs]
        assert [p.logprob for d in got.logprobs for p in d.values()] == \
            pytest.approx([p.logprob for d in want.logprobs for p in d.values()], abs=1e-4)
    assert told == sum(c.finish_reason == "stop" for c in final.values()) > 0
    assert not core.scheduler.requests
    assert all_blocks_free(SimpleNamespace(llm_engine=core))
