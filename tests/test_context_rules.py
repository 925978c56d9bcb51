"""The context an engine reserves and what it says about it (``ktquest.context``): max_seq_len 0 is the trained
context when its cache fits beside the weights, else the longest multiple of 1,024 tokens that does, with a note;
past the trained context, a warning naming it and the file's RoPE scaling."""

from __future__ import annotations

import re

import pytest
from test_model_args import tiny_model_parts, write_model

import ktquest
from ktquest.context import context_warning
from ktquest.kv import memory

MIB = 1 << 20
DENSE_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny llama's K and V: 2 layers x 2 KV heads x 16 x fp32


@pytest.fixture(scope="module")
def million(tmp_path_factory, tiny_bpe):
    """The tiny llama, its file saying it was trained to 1,048,576 tokens."""
    path = tmp_path_factory.mktemp("ctx") / "1m.gguf"
    return write_model(path, *tiny_model_parts(tiny_bpe), {"llama.context_length": 1 << 20})


def test_the_default_is_the_trained_context_when_it_fits(tiny_llama):
    e = ktquest.load(tiny_llama.path, device="cpu")
    assert e.max_seq_len == e.args.context_length == e.model.max_seq_len == 256
    assert e.context_note is None and e.context_warning is None


def test_a_million_trained_context_is_the_default_when_ram_holds_it(million, monkeypatch):
    weights = million.stat().st_size  # (on the CPU the weights take their share of the RAM first)
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: (1 << 20) * DENSE_TOKEN_BYTES + weights)
    e = ktquest.load(million, device="cpu")
    assert e.max_seq_len == e.cache.max_seq_len == 1 << 20  # no 32,768 cap
    assert e.context_note is None and e.context_warning is None
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: (1 << 20) * DENSE_TOKEN_BYTES + weights - 1)
    assert ktquest.load(million, device="cpu").max_seq_len == (1 << 20) - 1024  # the weights' RAM counted


def test_a_dense_default_that_does_not_fit_is_the_largest_that_does_and_says_so(million, monkeypatch):
    weights = million.stat().st_size
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: 100 * MIB + weights)  # 204,800 tokens of K/V
    e = ktquest.load(million, device="cpu")
    assert e.max_seq_len == e.cache.max_seq_len == 204_800  # the largest multiple of 1,024 that fits
    assert e.context_note.startswith("context 204,800 tokens (the model's trained 1,048,576 would need 512.0 MiB "
                                     "of RAM in dense mode and 100.0 MiB is available beside the weights")
    assert "\n" not in e.context_note and e.context_warning is None


def test_a_long_context_default_that_does_not_fit_is_the_largest_that_does_and_says_so(million, monkeypatch):
    weights = million.stat().st_size
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: 100 * MIB + weights)
    e = ktquest.load(million, device="cpu", mode="long_context")
    assert e.max_seq_len < 1 << 20 and e.max_seq_len % 1024 == 0
    assert e.context_note.startswith(f"context {e.max_seq_len:,} tokens (the model's trained 1,048,576 would need ")
    assert "of RAM in long_context mode and 100.0 MiB is available beside the weights" in e.context_note
    cfg, need = e.config, lambda n: sum(memory.store_need_bytes(e.config.long_context, e.args, n, cfg.chunk_size,
                                                               memory.layer_major_tokens(cfg, n)))
    assert need(e.max_seq_len) <= 100 * MIB < need(e.max_seq_len + 1024)  # the largest that fits


def test_an_explicit_context_is_kept(tiny_llama):
    e = ktquest.load(tiny_llama.path, device="cpu", max_seq_len=128)
    assert e.max_seq_len == 128 and e.context_note is None and e.context_warning is None


def test_a_context_past_the_trained_one_warns(tiny_llama):
    e = ktquest.load(tiny_llama.path, device="cpu", max_seq_len=1024)
    assert e.max_seq_len == 1024 and e.context_note is None
    assert e.context_warning == ("context 1,024 tokens is past the 256 the model was trained on: text past 256 "
                                 "tokens may be meaningless")


def test_the_warning_names_the_files_rope_scaling(tmp_path, tiny_bpe):
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 256}
    path = write_model(tmp_path / "yarn.gguf", *tiny_model_parts(tiny_bpe), yarn)
    e = ktquest.load(path, device="cpu", max_seq_len=1024)
    assert e.context_warning == ("context 1,024 tokens is past the 256 the model was trained on; its GGUF's yarn "
                                 "RoPE scaling, factor 4, original context 256 is meant to reach 1,024 tokens")
    assert context_warning(e.args, 2048).endswith("is meant to reach 1,024: text past it may be meaningless")


def test_the_warning_names_the_configs_dynamic_scaling(tiny_llama):
    e = ktquest.load(tiny_llama.path, device="cpu", max_seq_len=512, rope_scaling="dynamic", rope_scaling_factor=2.0)
    assert e.context_warning.startswith("context 512 tokens is past the 256 the model was trained on; the config's "
                                        "dynamic NTK RoPE scaling (factor 2)")


@pytest.mark.parametrize("ram_mib, whole", [(100, False), (310, True)])
def test_the_note_names_a_preset_that_holds_more_and_it_loads(million, monkeypatch, ram_mib, whole):
    """A long_context preset whose store takes fewer bytes a token than the dense cache (on the tiny model only
    with the prompt's own bytes left out: ``PROMPT_BYTES_PER_TOKEN``) is named, with what it holds; loaded as the
    note says (its -c where the preset's own max_seq_len is not that), it holds that here."""
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: ram_mib * MIB + million.stat().st_size)
    monkeypatch.setattr("ktquest.kv.memory.PROMPT_BYTES_PER_TOKEN", 0)
    e = ktquest.load(million, device="cpu")
    m = re.search(r"is available beside the weights; --config (\w+)(?: -c (\d+))? holds (it|[\d,]+ tokens)\)$",
                  e.context_note)
    assert m, e.context_note
    assert (m.group(3) == "it") == whole
    e2 = ktquest.load(million, m.group(1), device="cpu", **({"max_seq_len": int(m.group(2))} if m.group(2) else {}))
    assert e2.max_seq_len > e.max_seq_len
    assert e2.max_seq_len == (1 << 20 if whole else int(m.group(3).split()[0].replace(",", "")))
