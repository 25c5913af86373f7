"""Roofline mode: how close the engine gets to what this machine can do.

``minivllm bench roofline``. A CPU has two limits: how many floating-point operations it
can do per second (measured here as the best float32 matrix product on the model's own
largest weight shapes, with many rows and the weight in cache) and how many bytes per
second memory can deliver (a large read and a large copy). A step of the model does some
arithmetic (FLOPs) on some bytes (the weights, read once per step, and the KV cache it
attends over); its *arithmetic intensity* is FLOPs per byte. Below the *ridge*
(peak FLOP/s / bandwidth) a step cannot go faster than intensity x bandwidth: it is
memory-bound. Above, it is compute-bound. The roofline picture puts each kind of step
at its intensity and achieved FLOP/s under those two lines (Williams, Waterman and
Patterson, "Roofline", CACM 2009).

A decode step of one request multiplies every weight by one row: about 2 FLOPs per
4-byte weight read, far below the ridge, so memory bounds it. Thirty-two requests
decoding together reuse each weight 32 times (and add their KV caches to the bytes), and
a 512-token prefill 512 times: those are limited by arithmetic. That is why batching is
nearly free on a CPU (notebook 02), and why the engine's aim for big steps is the GEMM
peak.

What counts (:class:`ModelCost`): the FLOPs of every linear layer (2 per weight per row;
the vocabulary projection only for the rows that sample) and of attention (4 per query,
key and head dimension: QK^T and PV, causal). Norms, activations and rotary embeddings
are left out, as in MFU figures. The bytes are the least any implementation must move:
every weight once per step, the KV cache read over each sequence's context and written
for the new tokens.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minivllm.bench.common import engine_settings, load_tokenizer, save_figure
from minivllm.bench.timing import Timing
from minivllm.bench.tools import run_minivllm
from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.workload import chat_workload
from minivllm.trace import StepRecord, Trace
from minivllm.worker.linear_plan import FORWARD, plain_linears
from minivllm.worker.model_runner import kv_cache_bytes_per_token, kv_cache_shape


@dataclass(frozen=True)
class ModelCost:
    """FLOPs and least bytes moved of a step, from the model's shapes."""

    decoder_params: int
    """Weights of every linear layer but the vocabulary projection."""
    head_params: int
    """Weights of the vocabulary projection (computed only for the rows that sample)."""
    attn_flops_per_key: int
    """4 x layers x query heads x head dim: QK^T and PV for one query over one key."""
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def from_model(cls, model) -> ModelCost:
        head = model.get_output_embeddings()
        linears = plain_linears(model)
        params = {id(m): m.weight.numel() for m in linears}
        num_layers, _, head_dim = kv_cache_shape(model.config)
        dtype = next(model.parameters()).dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(
            decoder_params=sum(n for k, n in params.items() if k != id(head)),
            head_params=params.get(id(head), 0),
            attn_flops_per_key=4 * num_layers * model.config.num_attention_heads * head_dim,
            weight_bytes=sum(params.values()) * itemsize,
            kv_bytes_per_token=kv_cache_bytes_per_token(model, dtype),
        )

    def chunk(self, num_computed: int, num_new: int, samples: bool) -> tuple[int, int]:
        """(FLOPs, KV bytes) of one sequence's part of a step: ``num_new`` tokens after
        ``num_computed`` cached ones. Query ``p`` attends to ``p + 1`` keys."""
        keys = num_new * num_computed + num_new * (num_new + 1) // 2
        flops = 2 * num_new * self.decoder_params + 2 * self.head_params * samples + self.attn_flops_per_key * keys
        kv = self.kv_bytes_per_token * (num_computed + 2 * num_new)  # read the context and the new, write the new
        return flops, kv

    def step(self, step: StepRecord, trace: Trace) -> tuple[int, int]:
        """(FLOPs, bytes) of one recorded engine step. A prompt chunk samples when it
        reaches the end of the prompt (``trace.requests`` holds the prompt lengths)."""
        flops, nbytes = 0, self.weight_bytes
        for c in step.scheduled:
            prompt = trace.requests[c.request_id].num_prompt_tokens
            samples = not c.is_prefill or c.num_computed_tokens + c.num_new_tokens >= prompt
            f, b = self.chunk(c.num_computed_tokens, c.num_new_tokens, samples)
            flops, nbytes = flops + f, nbytes + b
        return flops, nbytes


MARKERS = {"eager": "o", "compiled": "s"}
"""How :func:`plot_roofline` marks each setting's points."""


@dataclass
class RooflinePoint:
    """One kind of step: its FLOPs, least bytes and seconds (summed over ``steps`` steps)."""

    name: str
    flops: float
    bytes: float
    seconds: float
    steps: int = 1
    samples: tuple[float, ...] = ()
    """Seconds of every step of this kind that ran (:func:`step_points` keeps the fastest
    as ``seconds``); empty for a point measured once."""
    setting: str = "eager"
    """How the engine ran the model: "eager", or "compiled" (``compilation_config``)."""

    @property
    def timing(self) -> Timing:
        """Seconds per step as a :class:`~minivllm.bench.timing.Timing`: median and middle
        half of ``samples`` (or the one measurement), for printing beside the point."""
        return Timing(self.name, self.samples or (self.seconds / self.steps,))

    @property
    def flop_s(self) -> float:
        return self.flops / self.seconds

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@dataclass
class RooflineReport:
    cpu: str
    threads: int
    peak_flop_s: float
    """The best float32 GEMM rate measured (:func:`gemm_peak`)."""
    read_bytes_s: float
    copy_bytes_s: float
    points: list[RooflinePoint]
    linear_backend: str
    gemm: list[dict] = field(default_factory=list)
    """Every GEMM timing behind the peak: shape, rows, backend, FLOP/s."""

    @property
    def bandwidth(self) -> float:
        """The memory roof: the faster of the two ways of moving bytes measured."""
        return max(self.read_bytes_s, self.copy_bytes_s)

    def bound(self, intensity: float) -> float:
        """The most FLOP/s a step of this intensity can reach on this machine."""
        return min(self.peak_flop_s, intensity * self.bandwidth)

    def table(self) -> str:
        lines = [f"{'step':<34} {'setting':<9} {'GFLOP':>8} {'ms/step':>9} {'GFLOP/s':>8} {'FLOP/B':>7} "
                 f"{'of peak':>8} {'of roof':>8}"]
        for p in self.points:
            lines.append(f"{p.name:<34} {p.setting:<9} {p.flops / p.steps / 1e9:>8.2f} {p.seconds / p.steps * 1e3:>9.1f} "
                         f"{p.flop_s / 1e9:>8.1f} {p.intensity:>7.1f} {p.flop_s / self.peak_flop_s:>8.0%} "
                         f"{p.flop_s / self.bound(p.intensity):>8.0%}")
        return "\n".join(lines)


@torch.inference_mode()
def gemm_peak(model, rows: Sequence[int] = (512, 2048), seconds: float = 0.25,
              backends: Sequence[str] = ("torch", "onednn", "transposed")) -> list[dict]:
    """FLOP/s of one float32 product ``rows x in @ in x out`` repeated for ``seconds``, for
    the two largest distinct weight shapes of the model's decoder layers, each backend and
    row count. One weight, used again and again, stays in cache: this is the arithmetic
    limit, not the memory one."""
    head = model.get_output_embeddings()
    shapes = {(m.in_features, m.out_features): m for m in plain_linears(model) if m is not head}
    largest = sorted(shapes.values(), key=lambda m: m.weight.numel(), reverse=True)[:2]
    results = []
    for m in largest:
        for n in rows:
            x = torch.randn(n, m.in_features, dtype=m.weight.dtype)
            for b in backends:
                fn = FORWARD[b]
                fn(x, m.weight, None)
                calls, t0 = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - t0) < seconds:
                    fn(x, m.weight, None)
                    calls += 1
                results.append({"shape": f"{m.in_features}x{m.out_features}", "rows": n, "backend": b,
                                "flop_s": 2 * n * m.in_features * m.out_features * calls / elapsed})
    return results


@torch.inference_mode()
def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bytes per second over ``nbytes``-sized float32 buffers (far larger
    than any cache), best of ``repeats``. A copy moves each byte twice (read and write)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    read = copy = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        read = max(read, nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        dst.copy_(src)
        copy = max(copy, 2 * nbytes / (time.perf_counter() - t))
    return read, copy


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"roofline-{tag}-{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()


def step_points(engine: LLMEngine, cost: ModelCost, prefill: int = 512, decode_batches: Sequence[int] = (1, 32),
                context: int = 256, repeats: int = 3, decode_steps: int = 8, seed: int = 0,
                setting: str = "eager") -> list[RooflinePoint]:
    """Single steps on a running engine: a ``prefill``-token prompt in one step (best of
    ``repeats``), and decode steps of each batch size with every sequence ``context``
    tokens long (the fastest of ``decode_steps`` steps in which exactly that many
    sequences decode and nothing else runs). Each point keeps every such step's duration
    in ``samples``, so a lesson can print the spread beside the fastest. Prompts are random
    token ids, never repeated, so the prefix cache cannot shorten the work."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def best(name: str, select) -> RooflinePoint:
        steps = [s for s in engine.trace.steps if select(s)]
        if not steps:
            raise RuntimeError(f"no step of the kind {name!r} ran; raise max_num_batched_tokens or max_num_seqs")
        s = min(steps, key=lambda s: s.duration)
        flops, nbytes = cost.step(s, engine.trace)
        return RooflinePoint(name, flops, nbytes, s.duration, samples=tuple(s.duration for s in steps),
                             setting=setting)

    points = []
    engine.trace.clear()
    for _ in range(repeats):
        _run(engine, [prompt(prefill)], 1)
    points.append(best(f"prefill, {prefill} tokens", lambda s: s.num_prefill_tokens == prefill))
    per_step = engine.config.max_num_batched_tokens
    for b in decode_batches:
        engine.trace.clear()
        # Prompts go in over several steps; the first to finish decodes meanwhile, so give
        # every request enough tokens to still be running once the last prompt is in.
        _run(engine, [prompt(context) for _ in range(b)], -(-b * context // per_step) + decode_steps + 1)
        points.append(best(f"decode, batch {b}, context {context}",
                           lambda s, b=b: s.num_prefill_tokens == 0 and s.num_decode_tokens == b))
    return points


def workload_point(engine: LLMEngine, cost: ModelCost, workload) -> RooflinePoint:
    """The whole throughput workload: every step's FLOPs and bytes over the wall time."""
    engine.trace.clear()
    result = run_minivllm(engine, workload)
    flops = nbytes = 0
    for s in engine.trace.steps:
        f, b = cost.step(s, engine.trace)
        flops, nbytes = flops + f, nbytes + b
    return RooflinePoint(f"throughput workload ({len(workload)} requests)", flops, nbytes, result.wall_s,
                         len(engine.trace.steps))


def roofline_benchmark(engine: LLMEngine, workload=None, gemm_seconds: float = 0.3,
                       bandwidth_bytes: int = 1 << 29, others: dict[str, LLMEngine] | None = None,
                       **step_kwargs) -> RooflineReport:
    """Measure the machine's two ceilings, then the engine's steps (:func:`step_points`,
    which takes ``step_kwargs``) and ``workload``, when given, the same steps on each of
    ``others`` (setting name -> an engine over the same model, e.g. ``"compiled"``), then
    the ceilings again.
    The ceilings are the best of both measurements: a machine shared with other programs
    is slower some of the time, and a fraction of a ceiling measured in a slow moment
    would flatter the engine."""
    from minivllm.worker.linear_autotune import cpu_description

    cost = ModelCost.from_model(engine.model)
    gemm = gemm_peak(engine.model, seconds=gemm_seconds)
    read, copy = memory_bandwidth(bandwidth_bytes)
    points = step_points(engine, cost, **step_kwargs)
    if workload is not None:
        points.append(workload_point(engine, cost, workload))
    for setting, other in (others or {}).items():
        points += step_points(other, cost, setting=setting, **step_kwargs)
    gemm += gemm_peak(engine.model, seconds=gemm_seconds)
    read2, copy2 = memory_bandwidth(bandwidth_bytes)
    return RooflineReport(cpu_description()["cpu"], torch.get_num_threads(), max(g["flop_s"] for g in gemm),
                          max(read, read2), max(copy, copy2), points, engine.linear_backend, gemm)


def plot_roofline(report: RooflineReport, ax=None):
    """Arithmetic intensity against achieved FLOP/s, log-log: the measured memory and
    compute ceilings as lines, one point per kind of step."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.figure import Figure

    if ax is None:  # a Figure outside pyplot: nothing is left open or shown twice
        fig = Figure(figsize=(7, 4.2), layout="constrained")
        ax = fig.subplots()
    else:
        fig = ax.figure
    ridge = report.peak_flop_s / report.bandwidth
    lo = min([p.intensity for p in report.points] + [ridge]) / 4
    hi = max([p.intensity for p in report.points] + [ridge]) * 4
    x = np.geomspace(lo, hi, 200)
    ax.loglog(x, [report.bound(i) / 1e9 for i in x], color="black", lw=2)
    # Along the slanted ceiling, just above it: every measured step sits on or under the
    # roof, so a label that follows the line never covers one (a level one would run into
    # the points as the line climbs). The angle is given in data space and turned into
    # the screen's by the axes (the line y = bandwidth * x is straight on log-log axes).
    x0 = (lo * ridge) ** 0.5 / 2
    ax.text(x0, x0 * report.bandwidth / 1e9 * 1.3, f"memory {report.bandwidth / 1e9:.1f} GB/s",
            rotation=np.degrees(np.arctan(report.bandwidth / 1e9)), transform_rotates_text=True,
            rotation_mode="anchor", fontsize=8, ha="left", va="bottom")
    ax.text(hi / 1.2, report.peak_flop_s / 1e9 * 1.1, f"float32 GEMM peak {report.peak_flop_s / 1e9:.0f} GFLOP/s",
            fontsize=8, ha="right", va="bottom")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    kinds = list(dict.fromkeys(p.name for p in report.points))  # one color per kind of step
    named = len({p.setting for p in report.points}) > 1  # name the setting only when there are several
    for p in report.points:  # one marker per setting: the same step eager and compiled side by side
        setting = f" ({p.setting})" if named else ""
        ax.plot(p.intensity, p.flop_s / 1e9, MARKERS.get(p.setting, "D"), color=colors[kinds.index(p.name) % len(colors)],
                ms=8, label=f"{p.name}{setting}: {p.flop_s / report.peak_flop_s:.0%} of peak")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of weights and KV cache)")
    ax.set_ylabel("GFLOP/s achieved")
    ax.set_ylim(top=report.peak_flop_s / 1e9 * 2)
    ax.set_title(f"Roofline of {report.cpu}, {report.threads} threads", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def main(args: argparse.Namespace) -> int:
    """``minivllm bench roofline``: the machine's ceilings, then the engine's steps and
    the throughput workload against them."""
    settings = [x.strip() for x in args.roofline_settings.split(",") if x.strip()]
    if not settings or settings[0] != "eager" or set(settings) - set(MARKERS):
        raise SystemExit(f"--roofline-settings: 'eager' first, then any of {sorted(MARKERS)}; got {args.roofline_settings!r}")
    engine = LLMEngine(EngineConfig(model=args.model, log_stats_interval=None, **engine_settings(args)))
    others = {}
    if "compiled" in settings:  # the same model object, compiled (minivllm.compilation)
        config = EngineConfig(model=args.model, log_stats_interval=None, compilation_config=3, **engine_settings(args))
        others["compiled"] = LLMEngine(config, engine.model, engine.tokenizer)
        print(f"compiled the model in {others['compiled'].model_runner.compile_seconds:.1f} s")
    workload = chat_workload(load_tokenizer(args.model), args.num_requests or 32, args.seed)
    report = roofline_benchmark(engine, workload, others=others)
    linear = f"{report.linear_backend} (eager), torch (compiled)" if others else report.linear_backend
    print(f"{report.cpu}, torch {torch.__version__}, {report.threads} threads; linear backend: {linear}")
    best: dict[tuple[str, int], dict[str, float]] = {}
    for g in report.gemm:  # the better of the two measurements of each
        rates = best.setdefault((g["shape"], g["rows"]), {})
        rates[g["backend"]] = max(rates.get(g["backend"], 0.0), g["flop_s"])
    for (shape, rows), rates in best.items():
        print(f"GEMM {rows} rows x {shape}: " + ", ".join(f"{b} {r / 1e9:.1f}" for b, r in rates.items()) + " GFLOP/s")
    print(f"ceilings: float32 GEMM peak {report.peak_flop_s / 1e9:.1f} GFLOP/s; memory read "
          f"{report.read_bytes_s / 1e9:.1f} GB/s, copy {report.copy_bytes_s / 1e9:.1f} GB/s; ridge at "
          f"{report.peak_flop_s / report.bandwidth:.1f} FLOP/B")
    print(report.table())
    save_figure(plot_roofline(report), args.figures, "bench_roofline.png")
    return 0

