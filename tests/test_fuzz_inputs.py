"""Fuzzing the Python inputs: GGUF metadata values and array counts, YAML files and ``--set`` values, and
the Python API's arguments.

- In the test process (the API): every example loads, or fails with a documented exception in one line
  (``GGUFError``, ``TokenizerError``, ``ConfigError``; ``TypeError`` for an argument of the wrong type),
  while ``_bounded`` guards the process: the address space capped (a runaway allocation is a MemoryError,
  not a swapping machine) and an alarm after a few seconds (a runaway loop is ``Hung``).
- Through the CLI: batches of ``ktquest chat --message`` runs in a child process under RLIMIT_AS and a
  timeout; each run exits 0 or 2 with one ``ktquest: error:`` line, never a traceback, and the child never
  dies of a signal. (A child per run costs seconds of imports: the batch is what keeps this affordable.)

Derandomized (the same examples every run, no example database): a few tens of seconds in all. The KV files a
chat saves are fuzzed in ``test_fuzz_kv_files.py`` (their header, table of arrays and bytes, checksums recomputed).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _bounded_process
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_model_args import tiny_model_parts, write_model

import ktquest
from ktquest.config import Config, ConfigError, GenerationConfig, LongContextConfig, load_config
from ktquest.engine import PLAIN_CHAT_NOTICE
from ktquest.formats.gguf import GGUFError, open_gguf
from ktquest.formats.tokenizer import TokenizerError
from ktquest.models.loader import read_gguf

resource = pytest.importorskip("resource", reason="the bounded child processes set POSIX resource limits")

REPO = Path(__file__).resolve().parents[1]
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DOCUMENTED = (GGUFError, TokenizerError, ConfigError)  # what loading a file or a config may raise
SECONDS = 10.0  # for one example in the test process; the slowest load of the tiny model is ~0.2 s
CHILD_BYTES = 4 << 30  # address space of a CLI child: torch's imports need ~2 GiB of it


def _bounded(extra_bytes: int = 1 << 30):
    """conftest's guard with this file's time limit: the address space capped, ``Hung`` after SECONDS."""
    return _bounded_process(SECONDS, extra_bytes)


def _one_line(e: BaseException) -> str:
    event(type(e).__name__)  # --hypothesis-show-statistics counts what each test reached
    msg = str(e)
    assert msg and "\n" not in msg, repr(msg)
    assert len(msg) < 1000, msg  # values in messages are shown bounded
    return msg


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_bpe):
    """A directory for the examples' files (each file written once: a model maps its file while loaded)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc")
    return tmp_path_factory.mktemp("fuzz")


_names = itertools.count()


def _fresh(directory: Path, suffix: str) -> Path:
    return directory / f"{next(_names)}{suffix}"


# ---- GGUF metadata values ----

_INT_RANGES = {"u8": (0, 2**8 - 1), "i8": (-(2**7), 2**7 - 1), "u16": (0, 2**16 - 1), "i16": (-(2**15), 2**15 - 1),
               "u32": (0, 2**32 - 1), "i32": (-(2**31), 2**31 - 1), "u64": (0, 2**64 - 1),
               "i64": (-(2**63), 2**63 - 1)}
_EDGES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 64, 255, 256, 319, 320, 321, 2**15, 2**20, 2**31 - 1, 2**31, 2**32 - 1,
          2**32, 2**33, 2**63 - 1, 2**64 - 1, -1, -2, -(2**31), -(2**63)]


def _typed_int(kind: str) -> st.SearchStrategy:
    lo, hi = _INT_RANGES[kind]
    return st.one_of(st.sampled_from([v for v in _EDGES if lo <= v <= hi]), st.integers(lo, hi)).map(
        lambda v: (kind, v))


GGUF_VALUES = st.one_of(
    st.sampled_from(sorted(_INT_RANGES)).flatmap(_typed_int),
    st.floats(width=32).map(lambda v: ("f32", v)),
    st.floats().map(lambda v: ("f64", v)),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-30, 0.5, 1.0, 1e30, 3e38, math.nan, math.inf, -math.inf]).map(
        lambda v: ("f32", v)),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.integers(0, 400), min_size=1, max_size=4),
    st.lists(st.text(max_size=4), min_size=1, max_size=3),
    st.lists(st.floats(width=32), min_size=1, max_size=3),
)
METADATA_KEYS = [f"llama.{k}" for k in (
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
    "rope.scaling.attn_factor")] + [f"tokenizer.ggml.{k}" for k in (
        "model", "pre", "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id",
        "eom_token_id", "add_bos_token", "tokens", "token_type", "merges", "scores")] + [
    "tokenizer.chat_template", "general.architecture", "general.name", "general.alignment"]
# what the scaling keys need to be read at all
_SCALING = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0}


@pytest.fixture(scope="module")
def parts(tiny_bpe):
    return tiny_model_parts(tiny_bpe)


def _load_and_answer(path: Path) -> None:
    """The whole way from a file to a reply, or a documented error in one line."""
    try:
        read_gguf(path)
        engine = ktquest.load(path, device="cpu", threads=1, max_new_tokens=2)
        assert isinstance(engine.generate("the cat"), str)
        assert isinstance(engine.chat_session().send("hi").text, str)
        event("answered")
    except DOCUMENTED as e:
        _one_line(e)


@settings(FUZZ, max_examples=120)
@given(changes=st.dictionaries(st.sampled_from(METADATA_KEYS), GGUF_VALUES | st.none(), min_size=1, max_size=3),
       scaled=st.booleans())
@example(changes={"llama.context_length": ("u32", 1 << 20)}, scaled=False)
@example(changes={"llama.block_count": ("u32", 1)}, scaled=False)
@example(changes={"tokenizer.ggml.eos_token_id": ("i32", -1)}, scaled=False)
@example(changes={"llama.rope.freq_base": ("f32", math.nan)}, scaled=False)
@example(changes={"tokenizer.ggml.model": "llama"}, scaled=False)
@example(changes={"tokenizer.ggml.merges": ["0"]}, scaled=False)
def test_gguf_metadata_values(workdir, parts, changes, scaled):
    md, tensors = parts
    path = write_model(_fresh(workdir, ".gguf"), md, tensors, (_SCALING if scaled else {}) | changes)
    with _bounded():
        _load_and_answer(path)


# ---- GGUF array counts and string lengths ----


def _array_offsets(data: bytes, key: str) -> tuple[int, int]:
    """Byte offsets of the element count of the array ``key`` and of its first element."""
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)  # then: value type u32, item type u32, count u64
    return at + 8, at + 16


ARRAYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]
COUNTS = st.one_of(st.sampled_from([0, 1, 319, 321, 2**31, 2**32 + 320, 2**33, 2**62, 2**64 - 1]),
                   st.integers(0, 2**64 - 1), st.integers(0, 1000))


@pytest.fixture(scope="module")
def model_bytes(workdir, parts):
    return write_model(_fresh(workdir, ".gguf"), *parts).read_bytes()


@settings(FUZZ, max_examples=60)
@given(key=st.sampled_from(ARRAYS), count=COUNTS, first_length=st.none() | COUNTS)
@example(key="tokenizer.ggml.tokens", count=2**33, first_length=None)
@example(key="tokenizer.ggml.merges", count=1, first_length=2**40)
def test_gguf_array_counts(workdir, model_bytes, key, count, first_length):
    data = bytearray(model_bytes)
    at_count, at_first = _array_offsets(data, key)
    data[at_count: at_count + 8] = struct.pack("<Q", count)
    if first_length is not None and key != "tokenizer.ggml.token_type":  # arrays of strings: its length
        data[at_first: at_first + 8] = struct.pack("<Q", first_length)
    path = _fresh(workdir, ".gguf")
    path.write_bytes(data)
    t0 = time.monotonic()
    with _bounded(extra_bytes=512 << 20):  # the whole file is 100 KB: a count must not allocate by itself
        try:
            open_gguf(path)
        except GGUFError as e:
            _one_line(e)
        else:
            _load_and_answer(path)
    assert time.monotonic() - t0 < 5.0


# ---- YAML and --set values ----

_SECTIONS = {"generation": GenerationConfig, "long_context": LongContextConfig}
CONFIG_KEYS = [f.name for f in dataclasses.fields(Config) if f.name not in _SECTIONS] + [
    f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
KEYS = st.one_of(st.sampled_from(CONFIG_KEYS), st.sampled_from(CONFIG_KEYS), st.sampled_from(CONFIG_KEYS).map(
    lambda k: k.split(".")[-1]), st.sampled_from(["generation", "long_context", "nonsense", "generation.nonsense",
                                                  "a.b.c", "threads.x", " ", "model.x"]))
# values a key may well take: most keys accept some of them, so the examples get past the config to the model
PLAUSIBLE = st.sampled_from([
    "0", "1", "2", "4", "8", "16", "32", "64", "256", "512", "1024", "0.5", "0.9", "1.1", "true", "false", "dense",
    "long_context", "cpu", "float32", "bfloat16", "q8_0", "fp32", "Q8_0", "Q4_0", "BF16", "FP32", "QUEST",
    "BLOCK_MAX", "BLOCK_MEAN", "FIXED", "DYNAMIC", "SHARED", "SEPARATE", "mean", "max"])
YAML_VALUES = st.one_of(
    PLAUSIBLE, PLAUSIBLE,
    st.sampled_from([
        "0", "-1", "1", "2", "3", "8", "64", "16384", "16385", "2147483647", "2147483648", "9223372036854775807",
        "9223372036854775808", "1e-05", "1.0e-5", "0.00001", "1e-300", "1.0e+309", "1e309", ".nan", ".inf",
        "-.inf", "0.5", "true", "no", "null", "~", "''", "'x'", "[]", "{}", "[1, 2]", "{a: 1}", "&a [1]",
        "&a [*a, *a]", "*a", "!!binary aGk=", "!!python/object/apply:os.getpid []", "!!str 3", "!!int 3",
        "0x10", "0o17", "1_000", "12:30:00", "2001-12-14", "=", ": :", "[", "{", "'", "\"", "- - -", "|\n  x",
        "dense", "long_context", "LONG_CONTEXT", "cuda", "cpu", "float16", "quest", "Q4_0", "FP16", "DYNAMIC",
        "x" * 300, "9" * 5000, "[" * 100 + "]" * 100, "\t1", "1 # comment", "%YAML 1.1", "\u00e9", "\udcff"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    st.text(max_size=16),
)


def _document(values: dict[str, str]) -> str:
    """A config file of ``values``: top-level keys and section blocks."""
    top = [f"{k}: {v}" for k, v in values.items() if "." not in k]
    sections: dict[str, list[str]] = {}
    for k, v in values.items():
        if "." in k:
            section, _, name = k.partition(".")
            sections.setdefault(section, []).append(f"  {name}: {v}")
    return "\n".join(top + [f"{s}:\n" + "\n".join(lines) for s, lines in sections.items()]) + "\n"


CONFIG_FILES = st.one_of(
    st.dictionaries(st.sampled_from([*CONFIG_KEYS, "nonsense", "generation.nonsense"]), YAML_VALUES,
                    max_size=3).map(_document).map(
        lambda s: s.encode("utf-8", "surrogateescape")),
    st.dictionaries(st.sampled_from(CONFIG_KEYS), PLAUSIBLE, max_size=3).map(
        lambda d: _document({"mode": "long_context", "max_seq_len": "256", "long_context.local_windows_len": "64"} | d)).map(
        str.encode),
    st.binary(max_size=64),
    st.sampled_from([
        b"a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nthreads: [*c, *c]\n",
        b"[" * 10000, b"{a: " * 1000, b"\xff\xfe\x00t", b"\xef\xbb\xbfthreads: 1\n", b"threads: \xc3\x28\n",
        b"--- \n--- \n", b"%YAML 1.1\n---\nthreads: 1\n", b"? [a, b]\n: 1\n", b"threads: !!python/name:os.system\n",
        b"\x00", b"threads:\t1\n", b"generation: 1\n", b"long_context: [1]\n", b"- 1\n", b"x" * (1 << 20 | 1)]),
)
_PAIRS = st.one_of(st.tuples(KEYS, YAML_VALUES), st.tuples(KEYS, PLAUSIBLE)).map("=".join)
SETS = st.integers(0, 7).flatmap(lambda i: st.text(max_size=12) if i == 7 else _PAIRS)  # key=value 7 in 8


@settings(FUZZ, max_examples=250)
@given(config=st.none() | CONFIG_FILES, sets=st.lists(SETS, max_size=3))
@example(config=b"threads: 100000\n", sets=["seed=99999999999999999999999"])
@example(config=None, sets=["temperature=0.00001", "chunk_size=1000000000"])
def test_yaml_and_set_values(workdir, config, sets):
    path = None
    if config is not None:
        path = _fresh(workdir, ".yaml")
        path.write_bytes(config)
    with _bounded(extra_bytes=256 << 20):  # a config is a few lines: nothing it says may cost memory
        try:
            cfg = load_config(path, sets)
        except ConfigError as e:
            _one_line(e)
        else:
            assert isinstance(cfg, Config)
            event("loaded")


TYPED_VALUES = st.one_of(st.sampled_from([0, 1, 2, 8, 64, 256, 0.5, 1.1, True, False, "dense", "long_context", "cpu",
                                          "Q8_0", "QUEST", "mean"]), st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
                         st.binary(max_size=4), st.lists(st.integers(), max_size=2),
                         st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                         st.sampled_from([0, 1, 64, 0.5, 1e-5, 1e-7, "quest", "long_context", 2**31, 2**63]))


@settings(FUZZ, max_examples=150)
@given(overrides=st.dictionaries(KEYS, TYPED_VALUES, max_size=3))
def test_typed_overrides(overrides):
    """The Python API's overrides (``ktquest.load(**overrides)``, (key, value) pairs) take the same checks."""
    with _bounded(extra_bytes=256 << 20):
        try:
            cfg = load_config(None, list(overrides.items()))
        except ConfigError as e:
            _one_line(e)
        else:
            assert isinstance(cfg, Config)
            event("loaded")


# ---- the Python API ----

TEXTS = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\n", "<|im_end|>", "\x00", "the cat"]))
PROMPTS = st.one_of(TEXTS, TEXTS, st.one_of(st.binary(max_size=8), st.none(), st.integers(), st.floats(),
                                            st.lists(st.text(max_size=3))))
GENERATION_KEYS = [f.name for f in dataclasses.fields(GenerationConfig)]


@pytest.fixture(scope="module")
def engine(workdir, parts):
    return ktquest.load(write_model(_fresh(workdir, ".gguf"), *parts), device="cpu", threads=1,
                        max_new_tokens=4)


@settings(FUZZ, max_examples=100)
@given(prompt=PROMPTS, options=st.dictionaries(st.sampled_from([*GENERATION_KEYS, "nonsense"]), TYPED_VALUES,
                                               max_size=3),
       on_text=st.sampled_from([None, None, None, print, 3]))
def test_generate_arguments(engine, prompt, options, on_text):
    if "max_new_tokens" in options and isinstance(options["max_new_tokens"], int):
        options["max_new_tokens"] = min(options["max_new_tokens"], 8)  # long replies are not the point here
    session = engine.chat_session()
    session.send("hello")
    held = engine.cache.pos
    with _bounded(extra_bytes=512 << 20):
        try:
            text = engine.generate(prompt, on_text=on_text if on_text is not print else (lambda s: None),
                                   **options)
        except (TypeError, ValueError) as e:  # ValueError: ConfigError, PromptTooLongError, an empty prompt
            _one_line(e)
            assert (engine.sequence.owner, engine.cache.pos) == (session, held)  # refused before any work
        else:
            assert isinstance(text, str)
            event("generated")


# ---- through the CLI, in a child process ----

_DRIVER = """
import contextlib, io, json, sys, time, traceback
from ktquest.cli import main
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            rc = 'uncaught'
            traceback.print_exc()
    results.append({'rc': rc, 'err': err.getvalue(), 's': time.monotonic() - t0})
json.dump(results, sys.__stdout__)
"""


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_BYTES, CHILD_BYTES))


def _run_cli(runs: list[list[str]]) -> list[dict]:
    """``ktquest.cli.main(argv)`` for each of ``runs`` in one child process under RLIMIT_AS and a timeout:
    [{rc, err (its stderr), s (seconds)}]."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(runs), capture_output=True, text=True,
                       env=env, timeout=120 + 15 * len(runs), check=False, preexec_fn=_limit_child)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])  # negative: a signal
    return json.loads(r.stdout)


def _check_runs(runs: list[list[str]]) -> None:
    for argv, res in zip(runs, _run_cli(runs), strict=True):
        lines = res["err"].strip().splitlines()
        assert res["rc"] in (0, 2), (argv, res)
        # a context past the model's trained one is said (ktquest.context), once, before anything else
        lines = [x for x in lines if not x.startswith("ktquest: context ")]
        if lines[:1] == [PLAIN_CHAT_NOTICE]:  # the test model has no chat template: said as the chat starts
            lines = lines[1:]
        assert len(lines) == 1, (argv, res)
        if res["rc"] == 2:
            assert lines[0].startswith("ktquest: error: "), (argv, res)
        else:
            assert re.fullmatch(r"\d+ prompt tokens, .*", lines[0]), (argv, res)
        assert res["s"] < 30, (argv, res)


def _chat_argv(model: Path, *extra: str) -> list[str]:
    return ["chat", "--model", str(model), "--message", "hi", "--max-new-tokens", "1", "--set=threads=1", *extra]


@settings(FUZZ, max_examples=2)
@example(cases=[(b"mode: long_context\nlong_context:\n  kv_type: Q4_0\n", []),
                (b"mode: long_context\nmax_seq_len: 2147483647\n", []),
                (None, ["mode=long_context", "max_seq_len=300", "block_size=1", "local_windows_len=1"]),
                (None, ["mode=long_context", "chunk_size=16384", "max_seq_len=300"]),
                (b"max_seq_len: 2147483647\n", []), (b"threads: 100000\n", ["temperature=0.00001"]),
                (b"\xff\xfe", []), (b"a: &a [x]\nb: [*a]\n", ["seed=-1"]), (None, ["threads=!!binary aGk="])])
@given(cases=st.lists(st.tuples(st.none() | CONFIG_FILES, st.lists(SETS, max_size=2)), min_size=12, max_size=12))
def test_cli_config_and_set_values(workdir, parts, cases):
    model = write_model(_fresh(workdir, ".gguf"), *parts)
    runs = []
    for config, sets in cases:
        extra = [f"--set={s}" for s in sets]
        if config is not None:
            path = _fresh(workdir, ".yaml")
            path.write_bytes(config)
            extra = ["--config", str(path), *extra]
        runs.append(_chat_argv(model, *extra))
    _check_runs(runs)


@settings(FUZZ, max_examples=2)
@given(changes=st.lists(st.dictionaries(st.sampled_from(METADATA_KEYS), GGUF_VALUES | st.none(), min_size=1,
                                        max_size=2), min_size=10, max_size=10))
def test_cli_gguf_metadata_values(workdir, parts, changes):
    md, tensors = parts
    always = [{"llama.context_length": ("u32", 1 << 20)}, {"llama.block_count": ("u32", 1)},
              {"tokenizer.ggml.bos_token_id": ("u32", 100000)}, {"llama.attention.head_count": ("u32", 0)}]
    runs = [_chat_argv(write_model(_fresh(workdir, ".gguf"), md, tensors, c)) for c in always + changes]
    _check_runs(runs)
