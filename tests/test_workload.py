"""The workload generator: seeded, deterministic, and within the ranges asked for."""

import pytest

from minivllm.sim.workload import chat_workload, corpus_documents, make_workload, summarize


def test_same_seed_same_workload_other_seed_other():
    a = make_workload(None, 40, seed=3, rate=2.0)
    b = make_workload(None, 40, seed=3, rate=2.0)
    c = make_workload(None, 40, seed=4, rate=2.0)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_lengths_within_ranges(dist):
    w = make_workload(None, 300, seed=0, prompt_len=(20, 300), output_len=(16, 128),
                      length_dist=dist, vocab_size=100)
    assert all(20 <= r.num_prompt_tokens <= 300 for r in w)
    assert all(16 <= r.max_tokens <= 128 for r in w)
    assert all(0 <= t < 100 for r in w for t in r.prompt_token_ids)
    # the draws spread over the range rather than sitting at one value
    assert len({r.num_prompt_tokens for r in w}) > 50
    assert [r.request_id for r in w] == [str(i) for i in range(300)]


def test_fixed_lengths_and_sampling_params():
    w = make_workload(None, 5, prompt_len=33, output_len=7)
    assert {r.num_prompt_tokens for r in w} == {33}
    p = w[0].sampling_params()
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 7, True)


def test_arrivals_all_at_once_or_poisson():
    assert {r.arrival_time for r in make_workload(None, 20)} == {0.0}
    w = make_workload(None, 2000, seed=1, rate=4.0)
    times = [r.arrival_time for r in w]
    assert times == sorted(times) and times[0] > 0
    mean_gap = times[-1] / len(times)
    assert abs(mean_gap - 0.25) < 0.025  # exponential gaps with mean 1/rate


def test_changing_the_rate_keeps_the_requests():
    a = make_workload(None, 30, seed=5, rate=1.0)
    b = make_workload(None, 30, seed=5, rate=8.0)
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    assert a[-1].arrival_time > b[-1].arrival_time


def test_shared_prefix_is_shared():
    w = make_workload(None, 10, seed=2, shared_prefix_len=64, prompt_len=(80, 200))
    prefix = w[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix for r in w)
    assert len({tuple(r.prompt_token_ids[64:70]) for r in w}) > 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="rate"):
        make_workload(None, 3, rate=0)
    with pytest.raises(ValueError, match="range"):
        make_workload(None, 3, prompt_len=(50, 10))
    with pytest.raises(ValueError, match="length_dist"):
        make_workload(None, 3, length_dist="zipf")


def test_corpus_is_python_docstrings():
    docs = corpus_documents()
    assert len(docs) > 100
    assert any("JSON" in d for d in docs)


@pytest.fixture(scope="module")
def tokenizer():
    from minivllm.bench import load_tokenizer

    try:
        return load_tokenizer()
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"SmolLM2 not available: {e}")


@pytest.mark.real_model
def test_chat_workload_is_chat_templated_and_deterministic(tokenizer):
    w = chat_workload(tokenizer, n=32, seed=0)
    assert w == chat_workload(tokenizer, n=32, seed=0)
    s = summarize(w)
    assert s["num_requests"] == 32
    assert 20 <= s["min_prompt"] and s["max_prompt"] <= 300
    assert 16 <= s["min_output"] and s["max_output"] <= 128
    text = tokenizer.decode(w[0].prompt_token_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert w[0].prompt and w[0].prompt in text
    # a shared system prompt of N tokens is the same token ids in every request
    shared = chat_workload(tokenizer, n=4, seed=1, shared_prefix_len=100, prompt_len=(150, 300))
    head = len(tokenizer.encode("<|im_start|>system\n", add_special_tokens=False))
    assert len({tuple(r.prompt_token_ids[: head + 100]) for r in shared}) == 1


def test_document_workload_groups_share_their_document_prefix():
    from minivllm.sim.workload import document_workload

    w = document_workload(None, num_documents=3, questions_per_document=4, document_len=32, rate=2.0)
    assert len(w) == 12 and len({r.request_id for r in w}) == 12
    assert all(b.arrival_time >= a.arrival_time for a, b in zip(w, w[1:]))
    by_doc: dict[str, list] = {}
    for r in w:
        by_doc.setdefault(r.request_id.split("-")[0], []).append(r.prompt_token_ids)
    assert len(by_doc) == 3
    for prompts in by_doc.values():
        assert all(p[:32] == prompts[0][:32] for p in prompts)  # the same document first
    firsts = [prompts[0][:32] for prompts in by_doc.values()]
    assert len({tuple(f) for f in firsts}) == 3  # different documents
    assert document_workload(None, 3, 4, document_len=32, rate=2.0) == w  # seeded
