"""Build the model to plan on the meta device: from a `module:factory` or a transformers config."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import ShardkitError
from ..install_hint import pip_install_extra
from ..sharding.wrap_policies import WrapPolicy, transformer_layers



def import_callable(target: str, what: str = "MODULE:FACTORY") -> Any:
    """The callable `module:attr` names (dots allowed after the colon), imported as `python -m`
    would import it (the working directory on the path)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ShardkitError(f"expected {what} (e.g. mypkg.models:build), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own files import
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ShardkitError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ShardkitError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ShardkitError(f"{target!r} is not callable")
    return obj


def from_factory(target: str, device: str = "meta") -> nn.Module:
    """Import `module:factory` (dots allowed after the colon) and call it under torch.device(device)."""
    obj = import_callable(target)
    with torch.device(device):
        model = obj()
    if not isinstance(model, nn.Module):
        raise ShardkitError(f"{target!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)  # numbers, true/false, null, lists
    except ValueError:
        return text


# Settings that count or size something (layers, heads, widths, positions, vocabulary): at least 1.
_SIZE_SETTING = re.compile(r"^(n_|num_)|(_size|_dim|_layers?|_heads?|_positions|_embd|_inner|"
                           r"_embeddings)$|^(d_model|d_ff|d_kv|vocab_size)$")


def _checked_override(config: Any, key: str, text: str) -> Any:
    """The value of `--set key=text`, of the type the setting has now; sizes at least 1."""
    current, value = getattr(config, key), _parse_value(text)
    where = f"--set {key}={text}: {type(config).__name__}.{key}"
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ShardkitError(f"{where} is true or false (now {json.dumps(current)}), got {text!r}")
    elif isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardkitError(f"{where} is an integer (now {current}), got {text!r}")
        if _SIZE_SETTING.search(key) and current >= 1 and value < 1:
            raise ShardkitError(f"{where} counts or sizes part of the model (now {current}); it "
                                f"must be at least 1, got {value}")
    elif isinstance(current, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ShardkitError(f"{where} is a number (now {current}), got {text!r}")
        value = float(value)
    return value


# Where transformers configs keep the most positions a model can embed (learned or rotary tables).
_POSITION_SETTINGS = ("n_positions", "max_position_embeddings", "n_ctx")


def check_sequence_fits(config: Any, model: nn.Module, seq: int | None) -> None:
    """Refuse a --seq longer than a learned position table of `model` (a real step would index
    past it; on meta it would not fail). Rotary and relative positions have no such table."""
    if seq is None:
        return
    tables = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for key in _POSITION_SETTINGS:
        limit = getattr(config, key, None)
        if (isinstance(limit, int) and not isinstance(limit, bool) and limit in tables
                and seq > limit):
            raise ShardkitError(f"--seq {seq} is longer than the {limit} positions of this "
                                f"{type(config).__name__} ({key}); HINT: plan a longer context "
                                f"with --set {key}={seq}")


def hf_config(name_or_json: str, overrides: Iterable[str] = ()) -> Any:
    """A transformers config: a model type (gpt2, llama, t5; no download) or a config.json path."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ShardkitError(f"--hf-config needs transformers, which is not installed; HINT: {pip_install_extra('hf')}") \
            from exc
    if os.path.exists(name_or_json):
        path = os.path.join(name_or_json, "config.json") if os.path.isdir(name_or_json) \
            else name_or_json
        with open(path) as f:
            values = json.load(f)
        model_type = values.pop("model_type", None)
        if model_type is None:
            raise ShardkitError(f"{path} has no model_type; it is not a transformers config.json")
        config = AutoConfig.for_model(model_type, **values)
    else:
        try:
            config = AutoConfig.for_model(name_or_json)
        except ValueError as exc:
            raise ShardkitError(f"unknown transformers model type {name_or_json!r} (and no such "
                                f"file); HINT: a model type such as gpt2, llama or t5, or a path "
                                f"to a config.json") from exc
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ShardkitError(f"--set needs KEY=VALUE, got {item!r}")
        if not hasattr(config, key):
            raise ShardkitError(f"{type(config).__name__} has no setting {key!r}")
        setattr(config, key, _checked_override(config, key, value))
    return config


def from_hf_config(config: Any, device: str = "meta") -> nn.Module:
    """The causal-LM (else seq2seq-LM, else base) model of `config`, built on `device`."""
    import transformers

    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        try:
            with torch.device(device):
                return getattr(transformers, auto).from_config(config)
        except ValueError:  # this config has no model of that kind
            continue
    raise ShardkitError(f"transformers has no model for {type(config).__name__}")


def wrap_by_class_names(model: nn.Module, names: Iterable[str]) -> WrapPolicy | None:
    """A transformer_layers policy for the module classes of `model` named in `names`."""
    wanted = [n.strip() for n in names if n.strip()]
    if not wanted:
        return None
    classes = {type(m).__name__: type(m) for m in model.modules()}
    unknown = [n for n in wanted if n not in classes]
    if unknown:
        raise ShardkitError(f"--wrap names class(es) {unknown} that the model does not use; "
                            f"its module classes are {sorted(classes)}")
    return transformer_layers({classes[n] for n in wanted})


def default_hf_wrap(model: nn.Module) -> list[str]:
    """The layer classes transformers itself keeps whole (`_no_split_modules`)."""
    return sorted(getattr(model, "_no_split_modules", None) or [])
