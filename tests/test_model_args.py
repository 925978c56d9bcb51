"""A model's hyper-parameters from GGUF metadata: every key range-checked (a GGUFError naming the file, the key,
the value and what is allowed), the blocks counted from the tensors, the weights finite, the default context
capped."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_SPECS, build_hf_model, finish_gguf, gguf_metadata, hf_to_gguf_tensors

from ktquest.formats.gguf import GGUFError
from ktquest.models.args import resolve_max_seq_len
from ktquest.models.loader import model_weights, read_gguf

NAN, INF = float("nan"), float("inf")


def tiny_model_parts(bpe) -> tuple[dict, dict]:
    """The tiny llama's metadata (tokenizer keys included) and tensors, to write with some keys changed."""
    spec, vocab = TINY_SPECS["llama"], len(bpe.tokens)
    md = gguf_metadata(spec, vocab) | {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": bpe.tokens,
        "tokenizer.ggml.token_type": bpe.token_types, "tokenizer.ggml.merges": bpe.merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}
    return md, hf_to_gguf_tensors(build_hf_model(spec, vocab), spec)


@pytest.fixture(scope="module")
def model_parts(tiny_bpe):
    return tiny_model_parts(tiny_bpe)


GGUF_TYPES = {"u8": "add_uint8", "i8": "add_int8", "u16": "add_uint16", "i16": "add_int16", "u32": "add_uint32",
              "i32": "add_int32", "u64": "add_uint64", "i64": "add_int64", "f32": "add_float32", "f64": "add_float64"}


def _add(w: gguf.GGUFWriter, key: str, value) -> None:
    """ints as the converter writes them (u32), else the narrowest type that holds them; ("i64", v) forces one."""
    if isinstance(value, tuple):
        getattr(w, GGUF_TYPES[value[0]])(key, value[1])
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        (w.add_uint32 if 0 <= value < 2**32 else w.add_int32 if -(2**31) <= value < 0 else w.add_uint64)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def write_model(path: Path, md: dict, tensors: dict, changes: dict | None = None) -> Path:
    """The model of ``md``/``tensors`` with metadata ``changes`` (None deletes a key)."""
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (md | (changes or {})).items():
        if value is not None:
            _add(w, key, value)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    finish_gguf(w)
    return path


def _assert_error(path: Path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg

# ---- metadata out of range ----


@pytest.mark.parametrize("changes, fragments", [
    ({"llama.attention.head_count": 0}, ["llama.attention.head_count=0", "an integer in [1, "]),
    ({"llama.attention.head_count_kv": 0}, ["llama.attention.head_count_kv=0", "[1, 4]"]),
    ({"llama.attention.head_count_kv": 8}, ["head_count_kv=8", "[1, 4]"]),
    ({"llama.attention.head_count_kv": 3}, ["head_count=4 is not a multiple of", "head_count_kv=3"]),
    ({"llama.context_length": 0}, ["llama.context_length=0", "[1, 2147483647]"]),
    ({"llama.context_length": -5}, ["llama.context_length=-5", "[1, 2147483647]"]),
    ({"llama.context_length": ("u64", 2**40)}, ["llama.context_length=1099511627776", "[1, 2147483647]"]),
    ({"llama.context_length": 256.0}, ["llama.context_length=256.0", "an integer"]),
    ({"llama.embedding_length": "abc"}, ["llama.embedding_length='abc'", "an integer"]),
    ({"llama.block_count": True}, ["llama.block_count=True", "an integer"]),
    ({"llama.rope.freq_base": 0.0}, ["llama.rope.freq_base=0.0", "a finite number > 1"]),
    ({"llama.rope.freq_base": -1.0}, ["llama.rope.freq_base=-1.0", "a finite number > 1"]),
    ({"llama.rope.freq_base": NAN}, ["llama.rope.freq_base=nan", "a finite number > 1"]),
    ({"llama.rope.freq_base": ("f64", INF)}, ["llama.rope.freq_base=inf", "a finite number > 1"]),
    ({"llama.attention.layer_norm_rms_epsilon": -0.5}, ["layer_norm_rms_epsilon=-0.5", "a finite number > 0"]),
    ({"llama.attention.layer_norm_rms_epsilon": NAN}, ["layer_norm_rms_epsilon=nan", "a finite number > 0"]),
    ({"llama.attention.layer_norm_rms_epsilon": 0.0}, ["layer_norm_rms_epsilon=0.0", "a finite number > 0"]),
    ({"llama.attention.key_length": 15, "llama.rope.dimension_count": 15}, ["key_length=15", "even"]),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, ["scaling.factor=0.0", "> 0"]),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.yarn_beta_fast": NAN}, ["yarn_beta_fast=nan"]),
    ({"llama.rope.scaling.type": "su"}, ["unsupported llama.rope.scaling.type 'su'", "yarn, longrope"]),
    ({"llama.rope.scaling.type": ("u32", 3)}, ["llama.rope.scaling.type=3", "a string"]),
    ({"llama.rope.scaling.type": "longrope"}, ["LongRoPE needs both tensors 'rope_factors_long.weight' and "
                                               "'rope_factors_short.weight'", "the file has neither"]),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.attn_factor": "big"},
     ["llama.rope.scaling.attn_factor='big'", "a finite number > 0"]),
    ({"general.architecture": ("i32", 5)}, ["general.architecture=5", "a string"]),
    ({"llama.block_count": 1}, ["llama.block_count=1", "blocks the file has tensors for (2: blk.0 to blk.1)"]),
    ({"llama.block_count": 0}, ["llama.block_count=0", "[1, "]),
    ({"llama.block_count": 2**31 - 1}, ["llama.block_count=2147483647", "(2: blk.0 to blk.1)"]),
    ({"llama.block_count": ("u64", 2**64 - 1)}, ["llama.block_count=18446744073709551615", "[1, 2147483647]"]),
    ({"tokenizer.ggml.bos_token_id": 100000}, ["tokenizer.ggml.bos_token_id=100000", "[0, 319]"]),
    ({"tokenizer.ggml.eos_token_id": -1}, ["tokenizer.ggml.eos_token_id=-1", "[0, 319]"]),
    ({"tokenizer.ggml.eos_token_id": "x"}, ["tokenizer.ggml.eos_token_id='x'", "an integer"]),
    ({"tokenizer.ggml.eot_token_id": 2.5}, ["tokenizer.ggml.eot_token_id=2.5", "an integer"]),
    ({"tokenizer.ggml.unknown_token_id": 320}, ["tokenizer.ggml.unknown_token_id=320", "[0, 319]"]),
    ({"tokenizer.ggml.token_type": [1, 2, 3]}, ["tokenizer.ggml.token_type has 3 entries", "(320)"]),
    ({"tokenizer.ggml.tokens": ["a", "b"]}, ["tokenizer.ggml.tokens has 2 tokens", "is 320"]),
    ({"tokenizer.ggml.tokens": [1, 2]}, ["tokenizer.ggml.tokens[0]=1 is not allowed", "a list of strings"]),
    ({"tokenizer.ggml.tokens": "abc"}, ["tokenizer.ggml.tokens='abc' is not allowed", "a list of strings"]),
    ({"tokenizer.ggml.token_type": [1.5] * 320}, ["token_type[0]=1.5", "a list of integers"]),
    ({"tokenizer.ggml.scores": [0.0] * 319 + [NAN]}, ["scores[319]=nan", "a list of finite numbers"]),
    ({"tokenizer.ggml.merges": ("f32", 0.0)}, ["tokenizer.ggml.merges=0.0", "a list of strings"]),
    ({"tokenizer.ggml.merges": ["0"]}, ["merges[0]='0' is not allowed", "'left right'"]),
    ({"tokenizer.ggml.merges": ["zz q"]}, ["merges[0]='zz q'", "left+right are tokens"]),
    ({"tokenizer.ggml.model": ("u32", 3)}, ["tokenizer.ggml.model=3", "a string"]),
    ({"tokenizer.chat_template": ["x"]}, ["tokenizer.chat_template=['x']", "a single value"]),
    ({"tokenizer.ggml.add_bos_token": ("u8", 1)}, ["tokenizer.ggml.add_bos_token=1", "true or false"]),
])
def test_metadata_out_of_range(tmp_path, model_parts, changes, fragments):
    md, tensors = model_parts
    _assert_error(write_model(tmp_path / "bad.gguf", md, tensors, changes), *fragments)


def test_block_count_above_the_blocks_present(tmp_path, model_parts):
    md, tensors = model_parts
    tensors = {k: v for k, v in tensors.items() if not k.startswith("blk.1.")}  # blocks 0 of 2
    _assert_error(write_model(tmp_path / "bad.gguf", md, tensors), "llama.block_count=2",
                  "(1: blk.0 to blk.0)")


def test_no_blocks_at_all(tmp_path, model_parts):
    md, tensors = model_parts
    tensors = {k: v for k, v in tensors.items() if not k.startswith("blk.")}
    _assert_error(write_model(tmp_path / "bad.gguf", md, tensors), "it has none")


def test_rope_freqs_must_be_finite_and_positive(tmp_path, model_parts):
    md, tensors = model_parts
    freqs = np.ones(8, np.float32)
    freqs[3] = 0.0
    _assert_error(write_model(tmp_path / "bad.gguf", md, tensors | {"rope_freqs.weight": freqs}),
                  "'rope_freqs.weight'", "finite numbers > 0")


EIGHT = np.ones(8, np.float32)  # head_dim 16: one RoPE divisor per frequency


@pytest.mark.parametrize("changes, extra, fragments", [
    ({}, {"rope_factors_long.weight": np.ones(7, np.float32), "rope_factors_short.weight": EIGHT},
     ["'rope_factors_long.weight' has shape [7], expected [head_dim/2] = [8]"]),
    ({}, {"rope_factors_long.weight": EIGHT, "rope_factors_short.weight": np.ones((2, 4), np.float32)},
     ["'rope_factors_short.weight' has shape [2, 4], expected [head_dim/2] = [8]"]),
    ({}, {"rope_factors_long.weight": EIGHT, "rope_factors_short.weight": np.array([1] * 7 + [NAN], "f4")},
     ["'rope_factors_short.weight' holds", "must be finite numbers > 0"]),
    ({}, {"rope_factors_long.weight": -EIGHT, "rope_factors_short.weight": EIGHT},
     ["'rope_factors_long.weight' holds", "must be finite numbers > 0"]),
    ({}, {"rope_factors_short.weight": EIGHT}, ["LongRoPE needs both tensors", "only one"]),
    ({"llama.rope.scaling.type": "yarn"}, {"rope_factors_long.weight": EIGHT,
                                            "rope_factors_short.weight": EIGHT},
     ["LongRoPE factors", "llama.rope.scaling.type='yarn'", "not supported"]),
    ({}, {"rope_factors_long.weight": EIGHT, "rope_factors_short.weight": EIGHT, "rope_freqs.weight": EIGHT},
     ["LongRoPE factors", "and rope_freqs.weight", "not supported"]),
    ({}, {"rope_freqs.weight": np.ones(16, np.float32)}, ["'rope_freqs.weight' has shape [16], expected"]),
])
def test_rope_factor_tensors_are_checked(tmp_path, model_parts, changes, extra, fragments):
    """LongRoPE's and llama3's per-frequency divisors: [head_dim/2] finite numbers > 0, LongRoPE's two sets
    together and with no other scaling."""
    md, tensors = model_parts
    _assert_error(write_model(tmp_path / "bad.gguf", md, tensors | extra, changes), *fragments)


def test_the_unchanged_parts_load(tmp_path, model_parts):
    md, tensors = model_parts
    a = read_gguf(write_model(tmp_path / "good.gguf", md, tensors)).args
    assert (a.n_layers, a.vocab_size, a.context_length) == (2, 320, 256)


def test_special_ids_never_read_are_not_checked(tmp_path, model_parts):
    """A padding id past the vocabulary (some converted files have one) loads, as in llama.cpp."""
    md, tensors = model_parts
    path = write_model(tmp_path / "pad.gguf", md, tensors, {"tokenizer.ggml.padding_token_id": 320})
    assert read_gguf(path).args.vocab_size == 320


# ---- the weights ----


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("name", ["blk.1.attn_k.weight", "output_norm.weight"])
def test_non_finite_weights_are_refused_at_load(tmp_path, model_parts, name, bad):
    md, tensors = model_parts
    w = tensors[name].copy()
    w.reshape(-1)[5] = bad
    contents = read_gguf(write_model(tmp_path / "bad.gguf", md, tensors | {name: w}))  # the header is fine
    with pytest.raises(GGUFError, match=rf"tensor '{name}' holds 1 non-finite values \(\['{bad}'\]\)"):
        model_weights(contents)


def test_weights_past_the_range_of_float16(tmp_path, model_parts):
    md, tensors = model_parts
    w = tensors["blk.0.ffn_up.weight"].copy()
    w[0, 0] = 1e5  # finite in float32, inf in float16
    contents = read_gguf(write_model(tmp_path / "big.gguf", md, tensors | {"blk.0.ffn_up.weight": w}))
    model_weights(contents)
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up.weight' holds values up to 1e\+05, past the range of "
                                        r"float16; load it with dtype float32 or bfloat16"):
        model_weights(contents, dtype=torch.float16)


# ---- the context ----


def test_a_model_alone_covers_its_trained_context(tmp_path, model_parts):
    """(The engine's default also asks what fits in memory: tests/test_context_rules.py.)"""
    md, tensors = model_parts
    args = read_gguf(write_model(tmp_path / "1m.gguf", md, tensors, {"llama.context_length": 1 << 20})).args
    assert args.context_length == 1 << 20  # what the file says
    assert resolve_max_seq_len(args, 0) == 1 << 20
    assert resolve_max_seq_len(args, 1024) == 1024  # asked for: the fit check decides
    small = read_gguf(write_model(tmp_path / "256.gguf", md, tensors)).args
    assert resolve_max_seq_len(small, 0) == 256


def test_a_family_describes_every_block(tiny_llama):
    """A family's ``read`` returns one BlockSpec a layer; any other count is a GGUFError naming the family."""
    from ktquest.formats.gguf import open_gguf
    from ktquest.models.args import Family, model_args
    from ktquest.models.block import BlockSpec

    f = open_gguf(tiny_llama.path)
    assert len(model_args(f, {"llama": Family(("llama",), lambda *a: {"blocks": (BlockSpec(),) * 2})}).blocks) == 2
    for blocks in ((BlockSpec(),), (BlockSpec(),) * 3, None, ("not a spec",) * 2):
        family = Family(("llama",), lambda *a, b=blocks: {"blocks": b})
        with pytest.raises(GGUFError, match="the llama family made .* block description"):
            model_args(f, {"llama": family})
