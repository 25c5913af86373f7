"""Priority scheduling through the engine, the offline API and the server.

The scheduler's own rules (admission order, victim choice, invariants under random
priorities) are in tests/test_scheduler.py; here the reference is transformers'
``generate()``: reordering and preempting requests must not change a single token.
"""

from __future__ import annotations

import pytest
from helpers import all_blocks_free, greedy, hf_greedy, random_workload
from tiny_chat import tiny_chat_llm

from minivllm import LLM
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompts, lengths = random_workload(16, VOCAB, seed=3, max_len=100, max_out=40)
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return model, prompts, lengths, refs


def test_greedy_is_token_identical_under_priority_scheduling_with_preemption(tiny):
    model, prompts, lengths, refs = tiny
    priorities = [i % 3 for i in range(len(prompts))]
    llm = LLM(model, scheduling_policy="priority", num_kv_blocks=24, max_num_batched_tokens=64,
              log_stats_interval=None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in lengths],
                        use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == refs
    steps = list(llm.trace.steps)
    assert sum(len(s.preempted) for s in steps) > 0, "the small cache should preempt"
    # Every victim was at least as unimportant as each request left running after it.
    prio = {o.request_id: p for o, p in zip(outs, priorities)}
    for s in steps:
        for victim in s.preempted:
            assert all(prio[victim] >= prio[rid] for rid in s.block_tables)
    assert all_blocks_free(llm)


def test_generate_admits_by_priority(tiny):
    """One seat: requests run one at a time, lower priority value first, ties in order."""
    model, prompts, lengths, refs = tiny
    llm = LLM(model, scheduling_policy="priority", max_num_seqs=1, log_stats_interval=None)
    priorities = [2, 0, 1, 0]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], [greedy(n) for n in lengths[:4]],
                        use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]


def test_priority_is_refused_under_fcfs_and_checked(tiny):
    model, prompts, lengths, _ = tiny
    llm = LLM(model, log_stats_interval=None)
    assert llm.llm_engine.config.scheduling_policy == "fcfs"
    one = [{"prompt_token_ids": prompts[0]}] * 2
    with pytest.raises(ValidationError, match="priority scheduling is not enabled") as e:
        llm.generate(one, greedy(4), use_tqdm=False, priority=[0, 1])
    assert e.value.param == "priority"
    assert not llm.llm_engine.has_unfinished_requests() and all_blocks_free(llm)  # nothing queued
    # All zeros is what fcfs means anyway: served.
    assert len(llm.generate(one, greedy(4), use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValidationError, match="one priority per prompt"):
        LLM(model, scheduling_policy="priority", log_stats_interval=None).generate(
            one, greedy(4), use_tqdm=False, priority=[0])
    with pytest.raises(ValidationError, match="scheduling_policy"):
        LLM(model, scheduling_policy="lifo")
    with pytest.raises(TypeError, match="integer"):
        llm.llm_engine.add_request("x", {"prompt_token_ids": [1, 2]}, greedy(2), priority="high")


# -- the server (in-process engine, the official client) --------------------------------------
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from minivllm.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_server_priority_field(policy):
    llm = tiny_chat_llm(scheduling_policy=policy)
    reference = llm.generate("Hello there", greedy(8), use_tqdm=False)[0].outputs[0].text
    with ServerThread(build_app(llm, api_key="k")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)
        chat = [{"role": "user", "content": "Hi"}]
        if policy == "priority":
            out = client.completions.create(model=None, prompt="Hello there", max_tokens=8, temperature=0,
                                            extra_body={"priority": -5, "ignore_eos": True})
            assert out.choices[0].text == reference
            r = client.chat.completions.create(model=None, messages=chat, max_tokens=4,
                                               extra_body={"priority": 3})
            assert r.choices[0].finish_reason in ("stop", "length")
        else:
            for call in (lambda: client.completions.create(model=None, prompt="Hello", max_tokens=2,
                                                           extra_body={"priority": 1}),
                         lambda: client.chat.completions.create(model=None, messages=chat, max_tokens=2,
                                                                extra_body={"priority": 1})):
                with pytest.raises(openai.BadRequestError) as e:
                    call()
                assert e.value.body["param"] == "priority"
                assert "priority scheduling is not enabled" in e.value.body["message"]
            out = client.completions.create(model=None, prompt="Hello there", max_tokens=8, temperature=0,
                                            extra_body={"priority": 0, "ignore_eos": True})
            assert out.choices[0].text == reference
        with pytest.raises(openai.BadRequestError):  # not an integer
            client.completions.create(model=None, prompt="Hello", max_tokens=2,
                                      extra_body={"priority": "high"})


def test_admitted_ahead_counts_the_batch_requests_that_went_before_a_waiting_chat_request():
    """Notebook 13's mechanism check, on the simulator (a virtual clock, so the same on every
    machine): under priority no batch request is admitted while a chat request waits; under
    fcfs exactly those batch requests still waiting when it arrived are."""
    import dataclasses

    from minivllm.bench.priority import admitted_ahead, priority_workload, request_group
    from minivllm.sim.cost_model import CostModel
    from minivllm.sim.replay import replay_workload
    from minivllm.sim.simulator import make_simulated_engine

    w = priority_workload(None, num_batch=8, num_interactive=4, interactive_rate=2.0, seed=0,
                          batch_prompt_len=(100, 200), batch_output_len=(16, 32),
                          interactive_prompt_len=(20, 40), interactive_output_len=(4, 8))
    ahead, traces = {}, {}
    for policy in ("fcfs", "priority"):
        engine = make_simulated_engine(CostModel.load(), scheduling_policy=policy, max_num_seqs=4)
        replay_workload(engine, w if policy == "priority" else [dataclasses.replace(r, priority=0) for r in w])
        ahead[policy], traces[policy] = admitted_ahead(engine.trace), engine.trace
    assert set(ahead["priority"]) == {r.request_id for r in w if request_group(r.request_id) == "interactive"}
    assert not any(ahead["priority"].values())
    assert any(ahead["fcfs"].values())  # the workload makes chat requests wait behind the flood
    reqs = traces["fcfs"].requests
    for rid, batch in ahead["fcfs"].items():
        still_waiting = {b for b, m in reqs.items()
                         if request_group(b) == "batch" and m.first_scheduled_time > reqs[rid].arrival_time}
        assert set(batch) == still_waiting
