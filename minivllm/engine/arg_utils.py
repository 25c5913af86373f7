"""Engine flags for the command line, made from :class:`~minivllm.config.EngineConfig`'s fields.

In vLLM: ``vllm/engine/arg_utils.py`` (``EngineArgs.add_cli_args`` makes the flags from
the fields).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Iterable
from typing import Any

from minivllm.config import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Add a flag for each named EngineConfig field: ``--max-num-seqs`` for
    ``max_num_seqs``, its type, default, choices and help from the field; a bool
    becomes a pair (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``)."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    hints = typing.get_type_hints(EngineConfig)
    for name in names:
        f = fields[name]
        kind = _plain_type(hints[name])
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        elif kind is dict:  # as vLLM: --speculative-config '{"method": "ngram", ...}'
            parser.add_argument(flag, type=json.loads, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"],
                                help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields that ``args`` carries, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if hasattr(args, f.name)}


def _plain_type(hint: Any) -> type:
    """``int | None`` -> ``int``: what argparse converts a flag's text with."""
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint
