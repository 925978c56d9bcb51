"""Shared helpers of the tools: long natural text, JSON output, the peer engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ktquest.eval.context_text import (  # noqa: F401  (the tools import them from here)
    HELD_OUT_TEXTS,
    TEXT_KINDS,
    context_tokens,
    filler_text,
    package_text,
    stdlib_text,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def mode_config(mode: str, known: dict[str, str | None]) -> str | None:
    """The config of a --modes entry: ``known[mode]`` (a path, or None for the defaults), else the preset
    ``configs/<mode>.yaml``. ValueError naming the known modes and presets when there is neither."""
    if mode in known:
        return known[mode]
    path = CONFIGS / f"{mode}.yaml"
    if not path.is_file():
        names = sorted(set(known) | {p.stem for p in CONFIGS.glob("*.yaml")})
        raise ValueError(f"--modes: unknown mode or preset {mode!r}; known: {', '.join(names)}")
    return os.fspath(path)


def variant_knobs(spec: str, config: str | None, overrides: list[str], cache):
    """``--variant NAME:KEY=VALUE[,KEY=VALUE]`` as (NAME, the cache's long_context knobs with those keys): the
    values checked as ``--set`` values are, the keys as decode-time knobs by ``retune`` on the still empty
    cache (ConfigError); a malformed spec or a key outside long_context is a ValueError."""
    import dataclasses

    from ktquest.config import load_config

    name, _, sets = spec.partition(":")
    if not name or not sets:
        raise ValueError(f"{spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    keys = [kv if "." in kv.split("=", 1)[0] else f"long_context.{kv}" for kv in sets.split(",")]
    for kv in keys:
        if not kv.startswith("long_context."):
            raise ValueError(f"{spec!r}: {kv.split('=', 1)[0]} is not a long_context key")
    want = load_config(config, [*overrides, *keys]).long_context
    lc = dataclasses.replace(cache.lc, **{f.name: getattr(want, f.name) for f in dataclasses.fields(want)
                                          if getattr(want, f.name) != getattr(cache.lc, f.name)})
    cache.retune(cache.retune(lc))  # a key that cannot change is refused here
    return name, lc


def write_json(path: str | Path, rows) -> None:
    write_atomic(Path(path), json.dumps(rows, indent=2) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it (a run killed mid-write: the queues
    skip a run whose JSON is there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def llama_cpp():
    """The llama_cpp module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp
