"""Runtime configuration: dataclasses are the schema (with defaults), YAML only loads into them.

Model hyper-parameters never live here: they come from the GGUF file (see ``ktquest.models.args``).
Every error names the source (file or ``--set``), the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ktquest import _C


class ConfigError(ValueError):
    """A YAML file or override does not fit the schema."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


@dataclass(slots=True)
class GenerationConfig:
    """How the next token is drawn (``ktquest.sampling``). The schema's defaults are greedy, for the Python
    API, the tools and the tests; ``ktquest chat`` starts from ``CHAT_GENERATION`` instead."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the best; 0 = off
    repeat_penalty: float = 1.0  # llama.cpp's: a recent token's logit divided (> 0) or multiplied (< 0); 1 = off
    repeat_last_n: int = 64  # the recent tokens the penalties look at
    presence_penalty: float = 0.0  # subtracted from a recent token's logit once
    frequency_penalty: float = 0.0  # subtracted once per occurrence among the recent tokens
    seed: int = 0

    def __post_init__(self) -> None:
        p = "generation."
        _check(self.max_new_tokens >= 1, p + "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        _check(self.temperature >= 0.0, p + "temperature", self.temperature, "a number >= 0 (0 = greedy)")
        _check(self.top_k >= 0, p + "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(0.0 < self.top_p <= 1.0, p + "top_p", self.top_p, "a number in (0, 1]")
        _check(0.0 <= self.min_p < 1.0, p + "min_p", self.min_p, "a number in [0, 1) (0 = off)")
        _check(self.repeat_penalty > 0.0, p + "repeat_penalty", self.repeat_penalty, "a number > 0 (1 = off)")
        _check(self.repeat_last_n >= 0, p + "repeat_last_n", self.repeat_last_n, "an integer >= 0")
        for key in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, key)
            _check(-2.0 <= value <= 2.0, p + key, value, "a number in [-2, 2] (0 = off)")
        _check(self.seed >= 0, p + "seed", self.seed, "an integer >= 0")


# What ``ktquest chat`` samples with unless the config or the command line says otherwise: replies that do not
# loop, from the kind of defaults llama.cpp's and Ollama's chats use. Tried on the bundled SmolLM2 (a poem,
# tips, a factual question; two seeds): at temperature 0.7 or 0.5 with min-p 0.05 the factual answer drifted
# into French, at 0.3 with min-p 0.1 it named Paris and no poem line came more than twice. --temperature 0
# is greedy.
CHAT_GENERATION = {"temperature": 0.3, "top_k": 40, "top_p": 0.95, "min_p": 0.1, "repeat_penalty": 1.1,
                   "repeat_last_n": 64}


# The store's enums are named by the C++ store (one table each in cpp/); the schema takes their names.
AnchorType = Literal[_C.ANCHOR_TYPES]
LINEAR_ANCHORS: tuple[str, ...] = _C.LINEAR_ANCHORS  # a block's score is one dot product with its anchor row
KVType = Literal[_C.KV_TYPES]
HeadSelectMode = Literal[_C.HEAD_MODES]


@dataclass(slots=True)
class LongContextConfig:
    """Knobs of ``mode: long_context`` (KTransformers' long-context options, same meanings)."""

    block_size: int = 64  # tokens per KV block in the DRAM store
    init_windows_len: int = 64  # initial (sink) tokens kept on the device, attended densely
    local_windows_len: int = 1024  # most recent tokens kept on the device, attended densely
    second_select_num: int = 16  # context blocks selected per decode step (per KV head in SEPARATE)
    threads_num: int = 0  # operator threads; 0 = the runtime's `threads`
    anchor_type: AnchorType = "QUEST"
    anchor_num: int = 2  # representative keys per block (QUEST uses min and max: exactly 2)
    kv_type: KVType = "FP16"
    dense_layer_num: int = 0  # the first N layers attend to every block
    head_select_mode: HeadSelectMode = "SEPARATE"
    preselect_block: bool = False  # SnapKV preselection once after prefill
    preselect_block_count: int = 64  # blocks that stay candidates after preselection
    preselect_window: int = 32  # last prompt tokens whose queries score the context (SnapKV W)
    preselect_pool_kernel: int = 7  # max-pool over neighbouring tokens
    # The preselected candidates' anchors scored from an int8 copy (one scale per block and head; QUEST
    # bounds rounded outward, so they stay upper bounds): half the bytes of fp16 anchors per decode step.
    int8_candidates: bool = False
    ada_budget: bool = False  # Ada-KV adaptive per-head budgets
    ada_alpha: float = 0.2  # uniform floor share
    ada_gqa_merge: Literal["mean", "max"] = "mean"
    token_step: int = 1  # reselect every N decode tokens
    layer_step: int = 1  # reselect every N layers

    def __post_init__(self) -> None:
        p = "long_context."
        _check(self.block_size >= 1, p + "block_size", self.block_size, "an integer >= 1")
        _check(self.init_windows_len >= 0, p + "init_windows_len", self.init_windows_len, "an integer >= 0")
        _check(self.local_windows_len >= 1, p + "local_windows_len", self.local_windows_len, "an integer >= 1")
        _check(self.second_select_num >= 0, p + "second_select_num", self.second_select_num, "an integer >= 0")
        _check(self.threads_num >= 0, p + "threads_num", self.threads_num, "an integer >= 0 (0 = runtime threads)")
        _check(self.anchor_num >= 1, p + "anchor_num", self.anchor_num, "an integer >= 1")
        if self.anchor_type == "QUEST":
            _check(self.anchor_num == 2, p + "anchor_num", self.anchor_num,
                   "exactly 2 with anchor_type QUEST (element-wise min and max keys)")
        if self.anchor_type in ("FIXED", "DYNAMIC"):
            _check(self.anchor_num <= self.block_size, p + "anchor_num", self.anchor_num,
                   f"at most block_size ({self.block_size}) with anchor_type {self.anchor_type}")
        # Q8_0/Q4_0 quantise each token row in groups of 32 along head_dim (a model property, checked when
        # the cache is built); every block size works, since scales are stored per row inside the tile.
        _check(self.dense_layer_num >= 0, p + "dense_layer_num", self.dense_layer_num, "an integer >= 0")
        _check(self.preselect_block_count >= 1, p + "preselect_block_count", self.preselect_block_count,
               "an integer >= 1")
        _check(self.preselect_window >= 1, p + "preselect_window", self.preselect_window, "an integer >= 1")
        _check(self.preselect_pool_kernel >= 1 and self.preselect_pool_kernel % 2 == 1,
               p + "preselect_pool_kernel", self.preselect_pool_kernel, "an odd integer >= 1")
        if self.int8_candidates:
            _check(self.preselect_block, p + "int8_candidates", self.int8_candidates,
                   "false unless preselect_block is true (only the preselected candidates have an int8 copy)")
            _check(self.anchor_type in LINEAR_ANCHORS, p + "int8_candidates",
                   self.int8_candidates, f"false with anchor_type {self.anchor_type} (int8 copies are of linear "
                   "anchors: QUEST, BLOCK_MAX, BLOCK_MEAN)")
        _check(0.0 <= self.ada_alpha <= 1.0, p + "ada_alpha", self.ada_alpha, "a number in [0, 1]")
        _check(self.token_step >= 1, p + "token_step", self.token_step, "an integer >= 1")
        _check(self.layer_step >= 1, p + "layer_step", self.layer_step, "an integer >= 1")


@dataclass(slots=True)
class Config:
    """The whole runtime configuration (``configs/default.yaml`` shows every key)."""

    model: str = ""  # GGUF path; "" = the bundled SmolLM2-135M-Instruct
    mode: Literal["dense", "long_context"] = "dense"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: fp16 on CUDA, fp32 on CPU
    # CPU decode matmuls: "q8_0" runs the int8 weight-only GEMV of ktquest._C (a quarter of the fp32
    # bytes per token); "fp32" uses torch. "auto" = q8_0 on CPU, unused on CUDA.
    decode_weights: Literal["auto", "fp32", "q8_0"] = "auto"
    threads: int = 0  # CPU threads for torch and the operators; 0 = all cores
    chunk_size: int = 512  # prefill chunk, tokens
    max_seq_len: int = 0  # KV capacity, tokens; 0 = the model's trained context length
    parse_special: bool = False  # chat: special-token text in messages and documents as control tokens
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    long_context: LongContextConfig = field(default_factory=LongContextConfig)

    def __post_init__(self) -> None:
        _check(self.threads >= 0, "threads", self.threads, "an integer >= 0 (0 = all cores)")
        _check(self.chunk_size >= 1, "chunk_size", self.chunk_size, "an integer >= 1")
        _check(self.max_seq_len >= 0, "max_seq_len", self.max_seq_len, "an integer >= 0 (0 = model context)")
        lc = self.long_context
        if self.mode == "long_context" and self.max_seq_len > 0:
            _check(lc.init_windows_len + lc.local_windows_len <= self.max_seq_len, "long_context.local_windows_len",
                   lc.local_windows_len,
                   f"init_windows_len + local_windows_len <= max_seq_len ({self.max_seq_len})")
            _check(lc.block_size <= self.max_seq_len, "long_context.block_size", lc.block_size,
                   f"at most max_seq_len ({self.max_seq_len})")

    def resolved_threads(self) -> int:
        return self.threads if self.threads > 0 else (os.cpu_count() or 1)


# ---- loading ----


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, source: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (bool/int/float/str/Literal), return it typed."""
    def bad() -> ConfigError:
        return ConfigError(f"{source}: {key}={value!r} has the wrong type: expected {_type_name(tp)}")

    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str):
            for a in allowed:  # enum names are case-insensitive: quest == QUEST
                if a.lower() == value.lower():
                    return a
        raise ConfigError(f"{source}: {key}={value!r} is not allowed: expected {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise bad()


def _build(cls: type, data: dict, source: str, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the top level'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"{source}: unknown key {name!r}; allowed keys here: {allowed}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, source, prefix=f"{name}.")
        else:
            kwargs[key] = _coerce(name, value, tp, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (for example long_context.block_size=32)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.split("."), value


def _resolve_short_key(path: list[str]) -> list[str]:
    """Let ``--set block_size=32`` mean ``long_context.block_size`` when the name is unique."""
    if len(path) != 1:
        return path
    hints = typing.get_type_hints(Config)
    if path[0] in hints:
        return path
    owners = [name for name, tp in hints.items()
              if dataclasses.is_dataclass(tp) and path[0] in {f.name for f in dataclasses.fields(tp)}]
    return [owners[0], path[0]] if len(owners) == 1 else path


def load_config(path: str | os.PathLike | None = None, overrides: list | None = None,
                base: dict | None = None) -> Config:
    """Load ``path`` (YAML; None = defaults) and apply ``overrides``: ``"key=value"`` strings (the value read
    as YAML, as ``--set`` gives them) or ``(key, value)`` pairs of typed values; keys dotted for sections.

    ``base``: keys (nested by section) that stand in for the schema's defaults, under the file and the
    overrides (``ktquest chat`` passes ``{"generation": CHAT_GENERATION}``)."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"{source}: no such config file")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        data = loaded
    for section, values in (base or {}).items():
        if isinstance(data.get(section, {}), dict):  # (a wrong type is reported by _build)
            data[section] = {**values, **data.get(section, {})}
    for item in overrides or []:
        keys, value = (item[0].split("."), item[1]) if isinstance(item, tuple) else _parse_override(item)
        keys = _resolve_short_key(keys)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {k!r} is not a section")
        node[keys[-1]] = value
        source = f"{source} + --set" if "--set" not in source else source
    return _build(Config, data, source)
