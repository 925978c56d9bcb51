"""Runtime configuration: dataclasses are the schema (with defaults), YAML only loads into them.

Model hyper-parameters never live here: they come from the GGUF file (``ktquest.models.args``), but for
``rope_scaling: dynamic`` (dynamic NTK, which GGUF cannot express). Every error names the source (file or
``--set``), the key, the value and what is allowed; reading the text is ``ktquest.config_file``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ktquest.config_file import ConfigError, check_utf8, find_config, parse_override, read_config_file, show
from ktquest.native import enums
from ktquest.native.enums import ANCHOR_TYPES, HEAD_MODES, KV_TYPES, LINEAR_ANCHORS, MAX_STICKY_BLOCKS

INT_MAX = 2**31 - 1  # every integer key but these two: the kernels take 32-bit sizes
SEED_MAX = 2**63 - 1  # numpy's and torch's seeds both take a non-negative int64
SEQ_LEN_MAX = 2**63 - 1  # max_seq_len: the fit checks refuse a cache that would not fit, with its bytes
MAX_CHUNK_SIZE = 16384  # a prefill chunk's activations and attention mask grow with it
MIN_TEMPERATURE = 1e-6  # see GenerationConfig


def max_threads() -> int:
    """The most threads a config may ask for: 4 per CPU core (more only adds contention)."""
    return 4 * (os.cpu_count() or 1)


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={show(value)} is not allowed: {allowed}")


def _check_threads(key: str, value: int, zero_means: str) -> None:
    _check(0 <= value <= max_threads(), key, value,
           f"an integer >= 0 (0 = {zero_means}) and at most {max_threads()} (4 per CPU core; this machine "
           f"has {os.cpu_count() or 1})")




@dataclass(slots=True)
class GenerationConfig:
    """How the next token is drawn (``ktquest.native.sample``). The schema's defaults are greedy, for the Python
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
    seed: int = field(default=0, metadata={"max": SEED_MAX})

    def __post_init__(self) -> None:
        p = "generation."
        _check_types(self, p)
        _check(self.max_new_tokens >= 1, p + "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        # Below the bound a draw is greedy in all but name (a logit gap of 1e-4 already has odds of e^-100);
        # the sampler divides in float64, where no temperature > 0 makes a draw NaN.
        _check(self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE, p + "temperature",
               self.temperature, f"0 (greedy) or a number >= {MIN_TEMPERATURE:g}")
        _check(self.top_k >= 0, p + "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(0.0 < self.top_p <= 1.0, p + "top_p", self.top_p, "a number in (0, 1]")
        _check(0.0 <= self.min_p < 1.0, p + "min_p", self.min_p, "a number in [0, 1) (0 = off)")
        _check(self.repeat_penalty > 0.0, p + "repeat_penalty", self.repeat_penalty, "a number > 0 (1 = off)")
        _check(self.repeat_last_n >= 0, p + "repeat_last_n", self.repeat_last_n, "an integer >= 0")
        for key in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, key)
            _check(-2.0 <= value <= 2.0, p + key, value, "a number in [-2, 2] (0 = off)")
        _check(self.seed >= 0, p + "seed", self.seed, "an integer in [0, 2**63 - 1]")


# ``ktquest chat``'s sampling unless the config or command line says otherwise (llama.cpp/Ollama-like, so replies
# do not loop). On the bundled SmolLM2 (a poem, tips, a factual question; two seeds) temperature 0.7 or 0.5 with
# min-p 0.05 drifted into French; 0.3 with min-p 0.1 named Paris, no poem line came more than twice.
CHAT_GENERATION = {"temperature": 0.3, "top_k": 40, "top_p": 0.95, "min_p": 0.1, "repeat_penalty": 1.1,
                   "repeat_last_n": 64}


# The store's enums are named by the C++ store (ktquest.native.enums); the schema takes their names.
AnchorType = Literal[ANCHOR_TYPES]
KVType = Literal[KV_TYPES]
HeadSelectMode = Literal[HEAD_MODES]


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
    # Candidates chosen by the prompt's last queries go stale over a long reply: every N decode steps a
    # layer's selection is taken from every context block and its picks join the candidates (0 = never)
    preselect_refresh: int = 0
    # The preselected candidates' anchors scored from an int8 copy (one scale per block and head; QUEST
    # bounds rounded outward, so they stay upper bounds): half the bytes of fp16 anchors per decode step.
    int8_candidates: bool = False
    ada_budget: bool = False  # Ada-KV adaptive per-head budgets
    ada_alpha: float = 0.2  # uniform floor share
    ada_gqa_merge: Literal["mean", "max"] = "mean"
    token_step: int = 1  # reselect every N decode tokens
    layer_step: int = 1  # reselect every N layers
    index_group: int = 0  # blocks per group of the selection's min/max index (cpp/index/); 0 = none
    # QUEST: a block scores (1 - c) * its bound of q.k + c * q . its centre (min + max) / 2; 0 = Quest's bound
    quest_centre: float = 0.0
    # The blocks of each KV head that took the largest share of its attention at a decode step, and the block
    # after each, stay selected at the layer's next step, within second_select_num (cpp/kvstore/sticky.cpp)
    sticky_blocks: int = 0
    rerank: int = 1  # decode's second stage: of rerank x k anchor picks, the k of most attention (rerank.h)

    def __post_init__(self) -> None:
        p = "long_context."
        _check_types(self, p)
        _check(self.block_size >= 1, p + "block_size", self.block_size, "an integer >= 1")
        _check(self.init_windows_len >= 0, p + "init_windows_len", self.init_windows_len, "an integer >= 0")
        _check(self.local_windows_len >= 1, p + "local_windows_len", self.local_windows_len, "an integer >= 1")
        _check(self.second_select_num >= 0, p + "second_select_num", self.second_select_num, "an integer >= 0")
        _check_threads(p + "threads_num", self.threads_num, "the runtime's threads")
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
        _check(1 <= self.preselect_window <= 1024, p + "preselect_window", self.preselect_window,
               "an integer in [1, 1024]")
        _check(1 <= self.preselect_pool_kernel <= 255 and self.preselect_pool_kernel % 2 == 1,
               p + "preselect_pool_kernel", self.preselect_pool_kernel, "an odd integer in [1, 255]")
        _check(self.preselect_refresh >= 0, p + "preselect_refresh", self.preselect_refresh,
               "an integer >= 0 (0 = never)")
        if self.int8_candidates:
            _check(self.preselect_block, p + "int8_candidates", self.int8_candidates,
                   "false unless preselect_block is true (only the preselected candidates have an int8 copy)")
            _check(self.anchor_type in LINEAR_ANCHORS, p + "int8_candidates",
                   self.int8_candidates, f"false with anchor_type {self.anchor_type} (int8 copies are of linear "
                   "anchors: QUEST, BLOCK_MAX, BLOCK_MEAN)")
        _check(0.0 <= self.ada_alpha <= 1.0, p + "ada_alpha", self.ada_alpha, "a number in [0, 1]")
        _check(self.token_step >= 1, p + "token_step", self.token_step, "an integer >= 1")
        _check(self.layer_step >= 1, p + "layer_step", self.layer_step, "an integer >= 1")
        _check(self.index_group >= 0, p + "index_group", self.index_group, "an integer >= 0 (0 = no index)")
        _check(0.0 <= self.quest_centre <= 1.0, p + "quest_centre", self.quest_centre, "a number in [0, 1]")
        _check(0 <= self.sticky_blocks <= MAX_STICKY_BLOCKS, p + "sticky_blocks", self.sticky_blocks,
               f"an integer in [0, {MAX_STICKY_BLOCKS}] (0 = off)")
        _check(1 <= self.rerank <= enums.MAX_RERANK, p + "rerank", self.rerank,
               f"an integer in [1, {enums.MAX_RERANK}] (1 = off)")
        if self.sticky_blocks:
            _check(self.token_step == 1, p + "sticky_blocks", self.sticky_blocks,
                   f"0 with token_step {self.token_step} (a step's blocks are kept for the next token's selection, "
                   "and with token_step > 1 the next token reuses the last one's instead)")
        if self.quest_centre:
            _check(self.anchor_type == "QUEST", p + "quest_centre", self.quest_centre,
                   f"0 with anchor_type {self.anchor_type} (the centre is of QUEST's min and max keys)")


@dataclass(slots=True)
class PrefillConfig:
    """How a prompt is read. ``mode`` (long_context): ``exact`` (every chunk attends every past token: O(N^2)) or
    ``sparse`` (past ``exact_tokens``, each chunk attends its windows exactly and, per KV head, the ``blocks``
    context blocks that ``select_queries`` of its queries score highest, and the stretch just before its
    local window: O(N); kv/long_context_pass.py ``prefill_blocks``). ``order`` (either cache): chunk-major or
    layer-major (``generate.prefill``)."""

    mode: Literal["exact", "sparse"] = "exact"
    exact_tokens: int = 4096  # positions read exactly before sparse prefill starts
    blocks: int = 128  # context blocks per KV head a chunk attends beyond its windows
    select_queries: int = 32  # the chunk's queries (spread over it) whose summed scores choose the blocks
    exact_tail: int = 512  # a prompt's last exact_tail tokens read every block (the question)
    # "chunk": each chunk through every layer; "layer": one layer over every chunk, then the next, its K/V on the
    # device until it crosses to the store once (kv/layer_prefill.py; exact prefill, not with DYNAMIC anchors)
    order: Literal["chunk", "layer"] = "chunk"
    slab_tokens: int = 0  # order layer: a prompt read as slabs of at most this many tokens (0 = whole)

    def __post_init__(self) -> None:
        _check_types(self, "prefill.")
        _check(self.exact_tokens >= 0, "prefill.exact_tokens", self.exact_tokens, "an integer >= 0")
        _check(self.blocks >= 1, "prefill.blocks", self.blocks, "an integer >= 1")
        _check(self.select_queries >= 1, "prefill.select_queries", self.select_queries, "an integer >= 1")
        _check(self.exact_tail >= 0, "prefill.exact_tail", self.exact_tail, "an integer >= 0")
        _check(self.slab_tokens >= 0, "prefill.slab_tokens", self.slab_tokens, "an integer >= 0 (0 = the whole prompt)")
        _check(self.order == "chunk" or self.mode == "exact", "prefill.order", self.order,
               "'chunk' with prefill.mode: sparse (layer-major prefill reads every block)")


@dataclass(slots=True)
class DualChunkConfig:
    """Dual chunk attention (models/dual_chunk.py: Qwen's 1M models past their trained 262,144 positions).
    ``mode`` auto: on where the file is a known 1M DCA model (its keys, or a qwen-family file of context
    1,010,000), said on stderr; on: also for another file (its sizes from here); off: never (positions past the
    trained context as they come). ``chunk_size`` / ``local_size`` 0: the file's."""

    mode: Literal["auto", "on", "off"] = "auto"
    chunk_size: int = field(default=0, metadata={"max": SEQ_LEN_MAX})
    local_size: int = field(default=0, metadata={"max": SEQ_LEN_MAX})
    scale_logits: bool = True  # past chunk_size, a query's logits times max(1, 0.1 ln(n / chunk_size) + 1)

    def __post_init__(self) -> None:
        _check_types(self, "dual_chunk.")
        _check(self.chunk_size >= 0, "dual_chunk.chunk_size", self.chunk_size, "an integer >= 0 (0 = the file's)")
        _check(self.local_size >= 0, "dual_chunk.local_size", self.local_size, "an integer >= 0 (0 = the file's)")
        if self.chunk_size and self.local_size:
            _check(self.local_size < self.chunk_size, "dual_chunk.local_size", self.local_size,
                   f"less than chunk_size ({self.chunk_size})")


MAX_STATE_CHECKPOINTS = 256


@dataclass(slots=True)
class Config:
    """The whole runtime configuration (``configs/default.yaml`` shows every key)."""

    model: str = ""  # GGUF path or a bundled model's name (formats/bundled.py); "" = smollm2-135m
    mode: Literal["dense", "long_context"] = "dense"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: fp16 on CUDA, fp32 on CPU
    # How the weights are held: "gguf" keeps each matrix in the file's encoding (Q4_K, Q8_0, ...), mapped and
    # read in place by the native kernels (CPU, float32 activations); "dequantize" converts every weight to
    # `dtype` (the reference path; CUDA's); "int8" to int8 rows with a scale a row (half fp16's memory, products
    # slower). "auto" = gguf on the CPU in float32; elsewhere dequantize, or int8 on a GPU where only that fits.
    weights: Literal["auto", "gguf", "dequantize", "int8"] = "auto"
    # How activations are rounded for the integer dot products on GGUF-encoded weights: "int8" per 32 or 256
    # values (ggml's route), in decode and in prefill's int8 GEMM (K-quants, Q4_0..Q5_1: about 1.2-2.4x torch's fp32
    # GEMM); "int16" per 32 values for the 32-value block types' decode (Q4_0..Q8_0; the K-quants keep int8),
    # 258 times less rounding at about int8's speed there, and every prefill on fp32 x (dequantized panels).
    # Small models have thin logit margins: int8 x flips the bundled SmolLM2's greedy answer (as it does under
    # llama.cpp).
    # "auto" = int16 for models under 1B parameters, int8 from 1B up.
    activations: Literal["auto", "int8", "int16"] = "auto"
    threads: int = 0  # CPU threads for torch and the operators; 0 = all cores
    chunk_size: int = 512  # prefill chunk, tokens
    # KV capacity, tokens; 0 = the model's trained context, or the most of it that fits (ktquest.context)
    max_seq_len: int = field(default=0, metadata={"max": SEQ_LEN_MAX})
    parse_special: bool = False  # chat: special-token text in messages and documents as control tokens
    # a Jinja chat template file used over the GGUF's own (a base model's, or one that is broken); "" = the file's
    chat_template: str = ""
    # RoPE scaling: "gguf" = the file's own (none, linear, yarn, llama3 or LongRoPE); "dynamic" = dynamic NTK with
    # rope_scaling_factor instead (HF's rope_type "dynamic", which GGUF cannot express; models/rope.py)
    rope_scaling: Literal["gguf", "dynamic"] = "gguf"
    rope_scaling_factor: float = 0.0  # dynamic NTK's factor (>= 1); 0 = unset (rope_scaling: gguf)
    sliding_window_keep: int = field(default=1024, metadata={"max": SEQ_LEN_MAX})  # gemma3: kv/sliding.py
    # hybrid models (qwen35, kv/recurrent.py): their DeltaNet state is copied at each prompt's start and end and
    # every state_checkpoint_tokens tokens of a prompt (0: turn boundaries only), the last state_checkpoints kept
    state_checkpoint_tokens: int = field(default=512, metadata={"max": SEQ_LEN_MAX})
    state_checkpoints: int = 8
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    long_context: LongContextConfig = field(default_factory=LongContextConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    dual_chunk: DualChunkConfig = field(default_factory=DualChunkConfig)

    def __post_init__(self) -> None:
        _check_types(self, "")
        _check_threads("threads", self.threads, "all cores")
        _check(1 <= self.chunk_size <= MAX_CHUNK_SIZE, "chunk_size", self.chunk_size,
               f"an integer in [1, {MAX_CHUNK_SIZE}]")
        _check(self.max_seq_len >= 0, "max_seq_len", self.max_seq_len,
               f"an integer in [0, {SEQ_LEN_MAX}] (0 = the model's context)")
        _check(self.sliding_window_keep >= 0, "sliding_window_keep", self.sliding_window_keep,
               f"an integer in [0, {SEQ_LEN_MAX}]")
        _check(self.state_checkpoint_tokens >= 0, "state_checkpoint_tokens", self.state_checkpoint_tokens,
               f"an integer in [0, {SEQ_LEN_MAX}] (0: at turn boundaries only)")
        _check(0 <= self.state_checkpoints <= MAX_STATE_CHECKPOINTS, "state_checkpoints", self.state_checkpoints,
               f"an integer in [0, {MAX_STATE_CHECKPOINTS}] (0: none; a rewind then reads the conversation again)")
        dynamic, factor = self.rope_scaling == "dynamic", self.rope_scaling_factor
        _check(factor >= 1.0 if dynamic else factor == 0.0, "rope_scaling_factor", factor,
               "a number >= 1 with rope_scaling: dynamic (the model's dynamic NTK factor, e.g. 2.0)" if dynamic else
               "0 (unset) unless rope_scaling is dynamic (the file's own scaling has its own factor)")
        lc = self.long_context
        _check(self.prefill.mode == "exact" or self.mode == "long_context", "prefill.mode", self.prefill.mode,
               "'sparse' only with mode: long_context (a dense cache reads every token)")
        _check(self.prefill.order == "chunk" or self.mode == "dense" or lc.anchor_type != "DYNAMIC", "prefill.order",
               self.prefill.order, "'chunk' with anchor_type DYNAMIC (its importances are a chunk's attention)")
        if self.mode == "long_context" and self.max_seq_len > 0:
            _check(lc.init_windows_len + lc.local_windows_len <= self.max_seq_len, "long_context.local_windows_len",
                   lc.local_windows_len,
                   f"init_windows_len + local_windows_len <= max_seq_len ({self.max_seq_len})")
            _check(lc.block_size <= self.max_seq_len, "long_context.block_size", lc.block_size,
                   f"at most max_seq_len ({self.max_seq_len})")

    def resolved_threads(self) -> int:
        return self.threads if self.threads > 0 else (os.cpu_count() or 1)


# ---- types ----


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any, int_max: int = INT_MAX) -> Any:
    """Check ``value`` against the annotation ``tp`` (bool/int/float/str/Literal), return it typed. Integers
    are at most ``int_max``, numbers finite."""
    def bad() -> ConfigError:
        return ConfigError(f"{key}={show(value)} has the wrong type: expected {_type_name(tp)}")

    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):  # YAML 1.1 reads on / off as booleans
            return "on" if value else "off"
        if isinstance(value, str):
            for a in allowed:  # enum names are case-insensitive: quest == QUEST
                if a.lower() == value.lower():
                    return a
        raise ConfigError(f"{key}={show(value)} is not allowed: expected {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            _check(value <= int_max, key, value, f"an integer <= {int_max}")
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range
                number = math.inf
            _check(math.isfinite(number), key, value, "a finite number")
            return number
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise bad()


def _check_types(obj: Any, prefix: str) -> None:
    """Each field of the schema dataclass ``obj`` checked against its annotation and stored typed (an int
    for a float key becomes a float); run first by every ``__post_init__``, so the Python API's values
    are checked as the YAML's are."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{prefix}{f.name}={show(value)} has the wrong type: expected a mapping of "
                                  f"its keys")
        else:
            setattr(obj, f.name, _coerce(prefix + f.name, value, tp, f.metadata.get("max", INT_MAX)))


# ---- loading ----


def _build(cls: type, data: dict, source: str, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the top level'} must be a mapping, "
                          f"got {show(data)}")
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"{source}: unknown key {show(name)}; allowed keys here: {allowed}")
        tp = hints[key]
        kwargs[key] = _build(tp, value, source, prefix=f"{name}.") if dataclasses.is_dataclass(tp) else value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _resolve_short_key(path: list[str]) -> list[str]:
    """Let ``--set block_size=32`` mean ``long_context.block_size`` when the name is unique."""
    if len(path) != 1:
        return path
    hints = _hints(Config)
    if path[0] in hints:
        return path
    owners = [name for name, tp in hints.items()
              if dataclasses.is_dataclass(tp) and path[0] in {f.name for f in dataclasses.fields(tp)}]
    return [owners[0], path[0]] if len(owners) == 1 else path


def load_config(path: str | os.PathLike | None = None, overrides: list | None = None,
                base: dict | None = None) -> Config:
    """Load ``path`` (YAML, or a packaged preset's name: ``"snapkv"``; None = defaults) and apply ``overrides``: ``"key=value"`` strings (the value read
    as YAML, as ``--set`` gives them) or ``(key, value)`` pairs of typed values; keys dotted for sections.

    ``base``: keys (nested by section) that stand in for the schema's defaults, under the file and the
    overrides (``ktquest chat`` passes ``{"generation": CHAT_GENERATION}``)."""
    data: dict = {}
    source = "defaults"
    if path is not None:  # a file, or a packaged preset's name (find_config)
        source = str(path)
        data = read_config_file(find_config(path))
    for section, values in (base or {}).items():
        if isinstance(data.get(section, {}), dict):  # (a wrong type is reported by _build)
            data[section] = {**values, **data.get(section, {})}
    for item in overrides or []:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            keys, value = item[0].split("."), item[1]
            check_utf8(item[0], f"--set {show(item[0])}")
        elif isinstance(item, str):
            check_utf8(item, f"--set {show(item)}")
            keys, value = parse_override(item)
        else:
            raise ConfigError(f"override {show(item)}: expected 'key=value' or a (key, value) pair")
        keys = _resolve_short_key(keys)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {show(item)}: {k!r} is not a section")
        node[keys[-1]] = value
        source = f"{source} + --set" if "--set" not in source else source
    return _build(Config, data, source)
