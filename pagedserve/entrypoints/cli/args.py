"""The engine flags of every command, derived from EngineConfig's fields (names, types, defaults, choices
and help all come from config.py; nothing is declared twice)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from pagedserve.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str}


def _flag_type(annotation: str):
    """'int | None' -> int, 'bool' -> bool, ..."""
    base = [t.strip() for t in annotation.split("|") if t.strip() != "None"]
    if base == ["dict"]:
        return str  # a JSON object on the command line (the config parses and checks it)
    if len(base) != 1 or base[0] not in (*_TYPES, "bool"):
        raise TypeError(f"EngineConfig field type {annotation!r} has no command-line form")
    return bool if base[0] == "bool" else _TYPES[base[0]]


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """One flag per EngineConfig field with cli=True (`--max-num-seqs`, `--[no-]decode-stack`, ...).

    Defaults are not copied into argparse: a flag not given leaves the field's own default in force."""
    for f in fields(EngineConfig):
        meta = f.metadata
        if not meta.get("cli", False):
            continue
        default = EngineConfig.default_of(f)
        help_text = meta["help"] + (f" (default: {default})" if default is not None else "")
        if f.name == "model" and positional_model:
            p.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=meta["help"])
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(f.type)
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            p.add_argument(flag, type=kind, choices=meta.get("choices"), default=argparse.SUPPRESS, help=help_text)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of the flags given (others keep the config's defaults), plus `overrides`."""
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    values.update(overrides)
    return EngineConfig(**values)


