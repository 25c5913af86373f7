"""The build-it-yourself hook: the engine builds its scheduler, KV cache manager and
sampler from classes named in the config (its own by default), so a learner's class runs
in place of the engine's without editing installed files."""

from __future__ import annotations

import pytest
from helpers import greedy, hf_greedy, random_workload, run_engine

from minivllm import LLM
from minivllm.core.scheduler import Scheduler
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

VOCAB = 256


class CountingScheduler(Scheduler):
    """The engine's scheduler, counting the steps it schedules."""

    calls = 0

    def schedule(self):
        type(self).calls += 1
        return super().schedule()


def test_a_class_given_as_scheduler_cls_is_the_one_that_schedules():
    model = make_tiny_model("llama", vocab_size=VOCAB)
    prompts, lengths = random_workload(4, VOCAB, seed=3, max_len=30, max_out=8)
    llm = LLM(model, scheduler_cls=CountingScheduler, log_stats_interval=None)
    outs = run_engine(llm, prompts, lengths)
    assert isinstance(llm.llm_engine.scheduler, CountingScheduler)
    assert CountingScheduler.calls == len(llm.trace.steps) > 0
    assert outs == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]


def test_a_class_in_a_file_is_loaded_by_path(tmp_path):
    (tmp_path / "my_sampler.py").write_text(
        "from minivllm.sample.sampler import Sampler\n"
        "class MySampler(Sampler):\n"
        "    pass\n")
    model = make_tiny_model("llama", vocab_size=VOCAB)
    llm = LLM(model, sampler_cls=f"{tmp_path / 'my_sampler.py'}:MySampler", log_stats_interval=None)
    assert type(llm.llm_engine.model_runner.sampler).__name__ == "MySampler"
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(4))[0]
    assert out.outputs[0].token_ids == hf_greedy(model, [1, 2, 3], 4)


@pytest.mark.parametrize("spec, says", [
    ("no_such_module:Scheduler", "cannot be loaded"),
    ("minivllm.core.scheduler:NoSuchClass", "cannot be loaded"),
    ("/no/such/file.py:Scheduler", "cannot be loaded"),
    ("minivllm.core.scheduler.Scheduler", "'module:Class'"),
    (42, "'module:Class'"),
])
def test_a_component_that_cannot_be_loaded_is_refused_by_name(spec, says):
    model = make_tiny_model("llama", vocab_size=VOCAB)
    with pytest.raises(ValidationError, match=says) as e:
        LLM(model, scheduler_cls=spec, log_stats_interval=None)
    assert e.value.param == "scheduler_cls"
