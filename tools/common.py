"""Shared helpers of the tools: long natural text, JSON output, the peer engine."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def stdlib_text(min_chars: int) -> str:
    """Python standard-library sources, concatenated in a fixed order until ``min_chars`` are reached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= min_chars:
            break
    if n < min_chars:
        raise RuntimeError(f"only {n} characters of standard-library source found under {root}")
    return "".join(parts)


def context_tokens(tokenizer, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` token ids of natural text (a tokenized slice of the stdlib sources)."""
    text = stdlib_text(n_tokens * 6)  # code is ~3-4 characters a token; 6 leaves room
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    if len(ids) < n_tokens:
        ids = tokenizer.encode(stdlib_text(n_tokens * 12), add_bos=False, parse_special=False)
    return ids[:n_tokens]


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


def write_json(path: str | Path, rows) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")


def llama_cpp():
    """The llama_cpp module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp
