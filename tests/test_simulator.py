"""The simulated runner: real scheduler and block manager, cost-model time, no model."""

import pytest

from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.sim.cost_model import FEATURES, CostModel, fit_cost_model, step_features
from minivllm.sim.replay import replay_workload
from minivllm.sim.simulator import (
    SimulatedModelRunner,
    VirtualClock,
    make_simulated_engine,
    simulate,
)
from minivllm.sim.workload import iter_workload, make_workload
from minivllm.trace import ScheduledChunk, StepRecord, Trace
from minivllm.worker.model_loader import make_tiny_model

COST = CostModel(
    {"const": 0.01, "prefill_tokens": 1e-3, "decode_requests": 2e-3, "decode_context": 1e-5,
     "prefill_attention": 1e-4},
    meta={"kv_bytes_per_token": 46080, "vocab_size": 49152, "max_position_embeddings": 8192},
)


def test_step_features_count_prefill_and_decode():
    chunks = [
        ScheduledChunk("a", 100, 0, True),     # first chunk of a prompt
        ScheduledChunk("b", 50, 100, True),    # a later chunk
        ScheduledChunk("c", 1, 30, False),     # decodes at contexts 31 and 11
        ScheduledChunk("d", 1, 10, False),
    ]
    const, prefill, decodes, context, attention = step_features(chunks)
    assert (const, prefill, decodes, context) == (1.0, 150, 2, 42)
    assert attention == pytest.approx((100 * 50.5 + 50 * (100 + 25.5)) / 1000)


def test_fit_recovers_a_linear_cost():
    true = dict(zip(FEATURES, [0.02, 4e-4, 3e-3, 2e-6, 5e-4]))
    trace = Trace(block_size=16, num_blocks=100, max_num_batched_tokens=512, max_num_seqs=64)
    t = 0.0
    for i in range(40):
        chunks = [ScheduledChunk(f"p{i}", 10 + 7 * (i % 9), 3 * i, True)] if i % 3 else []
        chunks += [ScheduledChunk(f"d{i}-{j}", 1, 20 + 5 * j + i, False) for j in range(i % 11)]
        seconds = CostModel(true).predict(chunks)
        trace.record(StepRecord(i, t, t + seconds, seconds, chunks, 0, 100, {}, {}, num_running=1))
        t += seconds
    cm = fit_cost_model([trace])
    for name in FEATURES:
        assert cm.coefficients[name] == pytest.approx(true[name], rel=1e-6, abs=1e-9)
    assert cm.meta["fit"]["r2"] == pytest.approx(1.0)


def test_fit_never_returns_a_negative_cost():
    # Step times that only a negative prompt-attention cost would fit exactly (attention
    # making a step faster, which no real step does): the fit keeps every coefficient
    # >= 0 and still explains the data as well as it can.
    wrong = dict(zip(FEATURES, [0.02, 1e-3, 3e-3, 2e-6, -2e-4]))
    trace = Trace(block_size=16, num_blocks=100, max_num_batched_tokens=512, max_num_seqs=64)
    t = 0.0
    for i in range(30):
        chunks = [ScheduledChunk(f"p{i}", 20 + 9 * (i % 7), 0, True)]
        chunks += [ScheduledChunk(f"d{i}-{j}", 1, 30 + j, False) for j in range(i % 5)]
        seconds = CostModel(wrong).predict(chunks)
        trace.record(StepRecord(i, t, t + seconds, seconds, chunks, 0, 100, {}, {}, num_running=1))
        t += seconds
    cm = fit_cost_model([trace])
    assert min(cm.coefficients.values()) >= 0
    assert cm.coefficients["prefill_attention"] == 0.0  # pinned at the bound it wanted to cross
    assert cm.meta["fit"]["r2"] > 0.9


def test_simulated_runner_advances_the_virtual_clock():
    engine = make_simulated_engine(COST, max_num_batched_tokens=64)
    assert isinstance(engine.model_runner, SimulatedModelRunner)
    clock = engine.clock
    assert isinstance(clock, VirtualClock)
    engine.add_request("a", {"prompt_token_ids": list(range(40))}, make_workload(None, 1, output_len=3)[0].sampling_params())
    engine.step()
    assert clock() == pytest.approx(0.01 + 40e-3 + 40 * 20.5 / 1000 * 1e-4)
    while engine.has_unfinished_requests():
        engine.step()
    m = engine.trace.requests["a"]
    assert len(m.token_times) == 3 and m.finished_time == clock()


def test_shipped_cost_model_loads():
    from importlib import resources

    from minivllm.sim.cost_model import DEFAULT_COST_MODEL

    if not resources.files("minivllm").joinpath("data", DEFAULT_COST_MODEL).is_file():
        pytest.skip("no fitted cost model yet: run `python -m minivllm.bench fit-simulator`")
    cm = CostModel.load()
    assert set(cm.coefficients) == set(FEATURES)
    assert cm.meta["command"] and "held_out" in cm.meta
    assert cm.predict([ScheduledChunk("a", 1, 100, False)]) > 0


def test_500_requests_all_finish_and_free_every_block():
    engine = make_simulated_engine(COST, num_kv_blocks=400, max_trace_steps=100)
    res = simulate(iter_workload(None, 500, seed=0, rate=50.0, vocab_size=49152), engine=engine)
    assert res.num_requests == res.num_finished == 500
    assert res.output_tokens == sum(r.max_tokens for r in iter_workload(None, 500, seed=0))
    assert res.no_block_leaked
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert not kv.req_to_blocks and not engine.scheduler.requests
    assert len(engine.trace.steps) == 100  # bounded by max_trace_steps
    assert not engine.trace.requests       # per-request metrics dropped once summarized
    assert res.num_preemptions > 0         # 400 blocks is tight: preemption was exercised
    assert all(x >= 0 for x in res.ttft) and res.simulated_seconds > 0


@pytest.mark.parametrize("num_blocks", [200, 24])  # ample, and so few that requests are preempted
def test_same_scheduling_decisions_as_the_real_runner(num_blocks):
    cfg = dict(block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=48, max_num_seqs=6,
               max_model_len=96, log_stats_interval=None, device="cpu")
    workload = make_workload(None, 12, seed=7, prompt_len=(5, 70), output_len=(2, 14), vocab_size=512)
    real = LLMEngine(EngineConfig(**cfg), make_tiny_model("llama"), None)
    sim = make_simulated_engine(COST, **cfg)
    replay_workload(real, workload)
    replay_workload(sim, workload)

    def decisions(engine):
        return [[(c.request_id, c.num_new_tokens, c.num_computed_tokens, c.is_prefill) for c in s.scheduled]
                for s in engine.trace.steps]

    assert decisions(sim) == decisions(real)
    assert [s.preempted for s in sim.trace.steps] == [s.preempted for s in real.trace.steps]
    if num_blocks == 24:
        assert any(s.preempted for s in real.trace.steps)
    for e in (real, sim):
        assert e.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks
