"""Ray as the executor and the replica backend, on a two-node Ray cluster on this machine.

The cluster is real: a head started with ``ray start --head`` and a second node joined
with ``ray start --address``, each with one CPU of its own, so a placement group of two
one-CPU bundles can only be placed across both nodes (and the second node has a
resource, ``second_node``, that shows where things went). The references are the same
runs without Ray: tensor parallelism against one rank, Ray replicas against local
processes behind the same router.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.data_parallel import free_port
from minivllm.exceptions import ValidationError
from minivllm.worker.model_loader import make_tiny_model

pytestmark = pytest.mark.multiprocess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node (``ray start --block``: ended with SIGTERM, which stops
    each node's own processes and nothing else Ray may run on this machine)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip('Ray is an optional extra: pip install "minivllm[ray]"')
    port = free_port()
    # Short: Ray's socket paths below it must fit in 107 bytes (pytest's folders do not).
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    address = f"127.0.0.1:{port}"
    # For this process's ray.init(), the nodes and what they start. Token authentication
    # on, with a token of the test's own, set alike everywhere as Ray asks: left to Ray
    # 2.60's defaults, a token in ~/.ray (which any local ray.init() writes) turns it on for
    # `ray start` but not for a client, which is then refused.
    env = {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    import ray  # after the settings: Ray reads its authentication mode when first imported
    common = ["--block", "--num-cpus", "1", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    logs = open(os.path.join(temp, "nodes.log"), "wb")
    nodes = [subprocess.Popen([ray_cli(), "start", "--head", "--port", str(port), "--include-dashboard", "false",
                               "--temp-dir", temp, *common], stdout=logs, stderr=subprocess.STDOUT)]
    try:
        _wait_for_nodes(ray, address, 1, nodes, logs.name)
        nodes.append(subprocess.Popen([ray_cli(), "start", "--address", address, "--resources",
                                       '{"second_node": 1}', *common], stdout=logs, stderr=subprocess.STDOUT))
        _wait_for_nodes(ray, address, 2, nodes, logs.name)
        yield address
    finally:
        ray.shutdown()
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
        logs.close()
        shutil.rmtree(temp, ignore_errors=True)
        for name, value in old.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})


def _wait_for_nodes(ray, address: str, n: int, procs, log: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if any(p.poll() is not None for p in procs):  # the folder goes at teardown: show its log now
            with open(log, errors="replace") as f:
                pytest.fail("a `ray start` exited; the end of its output:\n" + "".join(f.readlines()[-30:]))
        try:
            if not ray.is_initialized():
                ray.init(address=address, log_to_driver=False, include_dashboard=False)
            if len([node for node in ray.nodes() if node["Alive"]]) >= n:
                return
        except ConnectionError:
            pass
        assert time.monotonic() < deadline, f"the Ray cluster did not reach {n} node(s)"
        time.sleep(0.5)


# -- without Ray: the settings and the missing extra -----------------------------------------
def test_the_executor_backend_is_checked():
    with pytest.raises(ValidationError, match="distributed_executor_backend"):
        LLM(make_tiny_model(), distributed_executor_backend="threads")
    with pytest.raises(ValidationError, match="'uni' runs one process"):
        LLM(make_tiny_model(), tensor_parallel_size=2, distributed_executor_backend="uni")


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    with pytest.raises(ValidationError, match=r'pip install "minivllm\[ray\]"') as e:
        LLM(make_tiny_model(), tensor_parallel_size=2, distributed_executor_backend="ray",
            log_stats_interval=None)
    assert e.value.param == "distributed_executor_backend"
    from minivllm.entrypoints.ray_replicas import RayReplicas

    with pytest.raises(ValidationError, match=r"minivllm\[ray\]") as e:
        RayReplicas(2, []).start()
    assert e.value.param == "data_parallel_backend"


@pytest.mark.parametrize("args", [
    ["generate", "--tensor-parallel-size", "3", "--distributed-executor-backend", "ray", "Hi"],
    ["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
], ids=["generate", "serve"])
def test_the_command_without_ray_says_which_extra(args):
    code = ("import sys; sys.modules['ray'] = None; from minivllm.entrypoints.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert 'pip install "minivllm[ray]"' in out.stderr and "Traceback" not in out.stderr


def test_nothing_but_the_ray_backend_imports_ray():
    code = ("import sys; import minivllm, minivllm.entrypoints.cli, minivllm.engine.core, "
            "minivllm.entrypoints.data_parallel, minivllm.executor.ray_distributed_executor, "
            "minivllm.entrypoints.ray_replicas; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- tensor parallelism over Ray -------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_on_three_ranks_over_ray_equals_one_rank(cluster):
    pytest.importorskip("transformers")
    one = LLM("smollm2-135m-instruct", log_stats_interval=None)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.close()
    llm = LLM("smollm2-135m-instruct", tensor_parallel_size=3, distributed_executor_backend="ray",
              log_stats_interval=None)
    try:
        executor = llm.llm_engine.executor
        assert executor.num_nodes == 2, executor.placement  # the ranks really are on both nodes
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        assert all(len(t) == GREEDY.max_tokens for t in got)
        pool = llm.llm_engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks  # every block free again
        pids = executor.worker_pids
    finally:
        llm.close()
    _wait_gone(pids)


def test_a_ray_worker_that_dies_fails_the_step_naming_its_rank(cluster):
    """A model made in memory (no name to load by) reaches the worker through Ray's
    object store; killing that worker fails the next step with its rank, and the engine
    refuses further steps instead of hanging in an all-reduce."""
    model = make_tiny_model()
    ref = LLM(model, log_stats_interval=None)
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": [1, 2, 3, 4]}], GREEDY, use_tqdm=False)]
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", log_stats_interval=None)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], GREEDY, use_tqdm=False)] == want
        [pid] = llm.llm_engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tensor-parallel worker 1"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_bench_tensor_parallel_over_ray(cluster):
    """``minivllm bench tensor-parallel --distributed-executor-backend ray``'s comparison:
    T=2 over Ray gives T=1's tokens, with every step's compute and all-reduces timed."""
    from minivllm.bench.tensor_parallel import compare

    rows = compare("tiny", make_tiny_model(), [1, 2], [[1, 2, 3, 4], [5, 6, 7]], 8,
                   distributed_executor_backend="ray")
    assert rows[1]["identical_to_T1"] is True
    assert rows[1]["all_reduces_per_step"] == 2 * make_tiny_model().config.num_hidden_layers


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while os.path.exists(f"/proc/{pid}"):
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and line.split()[1] in "ZX" for line in f):
                    break
            assert time.monotonic() < deadline, f"worker {pid} outlived close()"
            time.sleep(0.1)


# -- replicas as Ray actors -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tiny_chat import save_tiny_chat

    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"))


def test_two_ray_replicas_route_and_hit_as_local_processes_do(cluster, tiny_dir):
    """The same document workload through prefix-aware routing, on local processes and on
    Ray actors: the same answers, the same prefix-cache hit rate, on both nodes."""
    from minivllm.bench.router import router_benchmark
    from minivllm.sim.workload import document_workload

    workload = document_workload(None, num_documents=2, questions_per_document=3, document_len=96,
                                 output_len=4, vocab_size=1000)
    argv = ["--max-model-len", "512"]
    [local] = router_benchmark(workload, tiny_dir, policies=("prefix_aware",), concurrency=2, serve_argv=argv)
    [on_ray] = router_benchmark(workload, tiny_dir, policies=("prefix_aware",), concurrency=2, serve_argv=argv,
                                data_parallel_backend="ray")
    assert on_ray["outputs"] == local["outputs"]
    assert on_ray["hit rate"] == local["hit rate"] > 0
    assert on_ray["per replica"] == local["per replica"] == "3/3"


def test_a_killed_replica_actor_loses_no_request_and_comes_back(cluster, tiny_dir):
    """Kill a replica's actor while it holds a request that has not begun streaming: the
    router retries it on the other replica, Ray restarts the actor (a fresh server at the
    same URL, with its tenants file written again on its node) and the router's probe
    brings it back into rotation."""
    import httpx
    import openai

    from minivllm.entrypoints.openai.api_server import ServerThread
    from minivllm.entrypoints.ray_replicas import RayReplicas
    from minivllm.entrypoints.router_app import build_router_app

    ray = pytest.importorskip("ray")
    argv = ["--model", tiny_dir, "--no-engine-process", "--log-stats-interval", "0", "--max-model-len", "512",
            "--uvicorn-log-level", "warning"]
    long = dict(max_tokens=450, temperature=0, extra_body={"ignore_eos": True})
    tenants = json.dumps({"tenants": [{"name": "t", "api_key": "sk-t"}]})
    with RayReplicas(2, argv, startup_timeout=120, files={"--tenants": tenants}) as replicas:
        before = replicas.where()
        assert len({node for node, _, _ in before}) == 2, before  # one replica on each node
        rt = ServerThread(build_router_app(replicas.urls, "round_robin", health_interval=0.5)).start()
        state = rt.app.state.router
        try:
            client = openai.OpenAI(base_url=rt.url + "/v1", api_key="sk-t", timeout=120, max_retries=0)
            model = client.models.list().data[0].id
            messages = [{"role": "user", "content": "Tell me a long story."}]
            result: dict = {}

            def plain() -> None:
                try:
                    result["answer"] = client.chat.completions.create(model=model, messages=messages, **long)
                except Exception as e:  # noqa: BLE001 - the assertion below reports it
                    result["error"] = e

            worker = threading.Thread(target=plain)
            worker.start()  # round robin: replica 0
            deadline = time.monotonic() + 60
            while running(replicas.urls[0]) < 1:
                assert time.monotonic() < deadline, "the request never reached replica 0"
                time.sleep(0.02)
            ray.kill(replicas.actors[0], no_restart=False)  # the actor dies, its server with it
            worker.join(120)
            assert "answer" in result, result.get("error")
            assert state.stats.retries == 1
            direct = openai.OpenAI(base_url=replicas.urls[1] + "/v1", api_key="sk-t", timeout=120)
            want = direct.chat.completions.create(model=model, messages=messages, **long)
            assert result["answer"].choices[0].message.content == want.choices[0].message.content

            deadline = time.monotonic() + 120
            while not state.replicas[0].healthy:  # restarted by Ray, probed back by the router
                assert time.monotonic() < deadline, "the replica did not come back"
                time.sleep(0.2)
            after = replicas.where()
            assert after[0] != before[0] and after[1] == before[1]  # a new actor and server for 0 only
            assert after[0][0] == before[0][0], "restarted in its bundle, on the same node"
            _wait_gone(before[0][1:])  # the old actor and its server
            ask = dict(json={"prompt": "Hi", "max_tokens": 3, "temperature": 0}, timeout=60)
            assert httpx.post(replicas.urls[0] + "/v1/completions", **ask).status_code == 401  # keys on again
            answer = httpx.post(replicas.urls[0] + "/v1/completions", headers={"Authorization": "Bearer sk-t"}, **ask)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        finally:
            rt.stop()
    _wait_gone([pid for _, *pids in after for pid in pids])


def running(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "minivllm:num_requests_running")
