"""KV-offload mode: what a prefix evicted from the engine's cache costs to get back.

``minivllm bench offload`` (the ``OffloadingConnector``, ``minivllm.distributed.kv_transfer``):
for prompts of each length, the time to first token when the prompt is

* **computed**: never seen before, the whole prompt is prefilled;
* **a local hit**: still in the engine's own cache (prefix caching, notebook 07);
* **loaded from RAM**: evicted from the engine's cache (its prefix cache reset), found in
  the CPU tier and copied back;
* **loaded from disk**: a new engine over the folder the first one wrote at shutdown.

In the last three only the prompt's last block runs through the model. The mode checks
that mechanism (the tokens each tier served) and that the first token is the same in all
four, and prints the transfer rates the connector measured.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile

from minivllm.bench.timing import Timing
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams

WAYS = ("computed", "local hit", "from RAM", "from disk")


def offload_config(num_cpu_blocks: int, disk_path: str) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks, "disk_path": disk_path}}


def _counter(llm: LLM, name: str, **labels) -> float:
    return sum(m.value for m in llm.get_metrics()
               if m.name == "minivllm:" + name and all(m.labels.get(k) == v for k, v in labels.items()))


def _first_token(llm: LLM, prompt: list[int]) -> tuple[int, float]:
    """The greedy first token of ``prompt`` and its time to first token."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids[0], out.metrics.ttft


def offload_benchmark(model, tokenizer, prompt_lens=(256, 1024), rounds: int = 3, seed: int = 0,
                      block_size: int = 16, max_num_batched_tokens: int = 512,
                      folder: str | None = None) -> list[dict]:
    """One row per prompt length: each way's time to first token as a :class:`Timing`
    over ``rounds`` prompts, the MB one prompt's KV takes, and the transfer rates (GB/s)
    measured by the connector. Raises if a tier did not serve what it should, or a first
    token differs between the ways."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = {n: [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(rounds)]
               for n in prompt_lens}
    blocks = sum(n // block_size + 1 for n in prompt_lens) * rounds
    with tempfile.TemporaryDirectory() if folder is None else contextlib.nullcontext(folder) as disk:
        kwargs = dict(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max(prompt_lens) + 1, log_stats_interval=None,
                      kv_transfer_config=offload_config(blocks, disk))
        first = LLM(model, tokenizer=tokenizer, **kwargs)
        ttft = {(n, w): [] for n in prompt_lens for w in WAYS}
        tokens = {}
        for r in range(rounds):
            for n in prompt_lens:
                p = prompts[n][r]
                for way in WAYS[:3]:
                    if way == "from RAM" and not first.reset_prefix_cache():
                        raise RuntimeError("the prefix cache could not be reset: blocks still in use")
                    before = _counter(first, "kv_offload_hits", tier="cpu")
                    token, t = _first_token(first, p)
                    _check(way == "from RAM", _counter(first, "kv_offload_hits", tier="cpu") - before,
                           n, block_size, way)
                    tokens.setdefault((n, r), token)
                    if token != tokens[n, r]:
                        raise RuntimeError(f"{way}: first token {token}, computed gave {tokens[n, r]}")
                    ttft[n, way].append(t)
        first.close()  # the CPU tier goes to disk
        second = LLM(model, tokenizer=tokenizer, **kwargs)
        for r in range(rounds):
            for n in prompt_lens:
                before = _counter(second, "kv_offload_hits", tier="disk")
                token, t = _first_token(second, prompts[n][r])
                _check(True, _counter(second, "kv_offload_hits", tier="disk") - before, n, block_size,
                       "from disk")
                if token != tokens[n, r]:
                    raise RuntimeError(f"from disk: first token {token}, computed gave {tokens[n, r]}")
                ttft[n, "from disk"].append(t)
        rates = {t: _counter(llm, "kv_offload_bytes", transfer_type=t)
                 / max(_counter(llm, "kv_offload_seconds", transfer_type=t), 1e-9) / 1e9
                 for llm, t in ((first, "device_to_cpu"), (first, "cpu_to_device"),
                                (second, "disk_to_device"))}
        block_bytes = first.llm_engine.kv_connector.block_bytes
    return [{"prompt tokens": n,
             **{way: Timing(f"{n} tokens, {way}", tuple(ttft[n, way])) for way in WAYS},
             "KV MB": n // block_size * block_bytes / 1e6,
             **{f"{t} GB/s": v for t, v in rates.items()}}
            for n in prompt_lens]


def _check(loaded: bool, hits: float, n: int, block_size: int, way: str) -> None:
    """The tier served every full block but the last token's, or nothing, as ``way`` says."""
    expect = (n - 1) // block_size * block_size if loaded else 0
    if hits != expect:
        raise RuntimeError(f"{way}: the connector served {hits:.0f} tokens of {n}, expected {expect}")


def main(args: argparse.Namespace) -> int:
    from minivllm.worker.model_loader import load_model

    model, tok = load_model(args.model)
    lens = tuple(int(x) for x in args.prompt_lens.split(","))
    rows = offload_benchmark(model, tok, lens, args.rounds, args.seed, args.block_size,
                             args.max_num_batched_tokens)
    print(f"time to first token (median, middle half of {args.rounds} prompts), one request at a "
          f"time; loaded: every block but the last token's")
    print("| prompt tokens | KV MB | " + " | ".join(WAYS) + " |")
    print("| --- | --- |" + " --- |" * len(WAYS))
    for row in rows:
        cells = [f"{row[w].median * 1e3:.0f} ms ({row[w].low * 1e3:.0f}-{row[w].high * 1e3:.0f})"
                 for w in WAYS]
        print(f"| {row['prompt tokens']} | {row['KV MB']:.1f} | " + " | ".join(cells) + " |")
    last = rows[-1]
    print("copy rates measured by the connector: " + ", ".join(
        f"{k.removesuffix(' GB/s')} {v:.1f} GB/s" for k, v in last.items() if k.endswith("GB/s")))
    return 0
