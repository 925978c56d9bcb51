"""Every way a model file can fail to load is one error, ``ktquest.GGUFError``, whose message names the file; the
command line says it in one line. The details of each check (which key, which tensor, which byte) are tested
where the check is: test_gguf.py (the reader), test_model_args.py (the metadata)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import finish_gguf
from test_cli import _main, _one_error_line
from test_model_args import _add, tiny_model_parts

import ktquest


@pytest.fixture(scope="module")
def parts(tiny_bpe):
    return tiny_model_parts(tiny_bpe)


def _write(path: Path, parts, changes: dict | None = None, tensors: dict | None = None, arch: str = "llama") -> Path:
    """The tiny llama with metadata ``changes`` (None deletes a key) and tensors replaced (None deletes one)."""
    md, ts = parts
    w = gguf.GGUFWriter(path, arch)
    for key, value in (md | (changes or {})).items():
        if value is not None and key != "general.architecture":
            _add(w, key, value)
    for name, t in (ts | (tensors or {})).items():
        if t is not None:
            w.add_tensor(name, t)
    finish_gguf(w)
    return path


def _bytes(tmp: Path, parts, edit) -> Path:
    """The tiny llama's bytes as ``edit(data)`` returns them."""
    path = tmp / "edited.gguf"
    path.write_bytes(edit(_write(tmp / "whole.gguf", parts).read_bytes()))
    return path


def _patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _data_offset(data: bytes, name: str) -> int:
    """Where a 2-D tensor's data offset is written in its tensor info (name, n_dims, 2 dims, type, offset)."""
    n = name.encode()
    return data.index(struct.pack("<Q", len(n)) + n) + 8 + len(n) + 4 + 16 + 4


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo.gguf")
    return tmp / "fifo.gguf"


def _nan(parts, name: str) -> np.ndarray:
    t = parts[1][name].copy()
    t.flat[3] = np.nan
    return t


def _config(tmp: Path, model: Path) -> Path:
    (tmp / "model.yaml").write_text(f"model: {model}\nthreads: 1\n")
    return model


VOCAB = 320  # tiny_bpe's
# what makes the file -> (model path, fragments of the message); ("config", path): named by a YAML config
CASES = {
    "no such file": (lambda t, p: t / "nope.gguf", ["no such file"]),
    "a directory": (lambda t, p: t, ["a directory, not a GGUF file"]),
    "a FIFO (never opened)": (lambda t, p: _fifo(t), ["a FIFO, not a GGUF file"]),
    "a device": (lambda t, p: Path("/dev/zero"), ["a character device, not a GGUF file"]),
    "a name too long": (lambda t, p: t / ("m" * 300 + ".gguf"), ["cannot be read: File name too long"]),
    "empty": (lambda t, p: _bytes(t, p, lambda d: b""), ["not a GGUF file (magic bytes b''"]),
    "not GGUF": (lambda t, p: _bytes(t, p, lambda d: b"PK\x03\x04 definitely not gguf"), ["not a GGUF file"]),
    **{f"truncated to {f:.0%}": (lambda t, p, f=f: _bytes(t, p, lambda d: d[: int(len(d) * f)]), ["truncated"])
       for f in (0.02, 0.5, 0.9)},
    "a version it cannot read": (lambda t, p: _bytes(t, p, lambda d: _patched(d, 4, "<I", 99)), ["version 99"]),
    "tensor data past the end": (
        lambda t, p: _bytes(t, p, lambda d: _patched(d, _data_offset(d, "blk.0.attn_k.weight"), "<Q", 2**40)),
        ["tensor 'blk.0.attn_k.weight' ends at byte"]),
    "metadata of the wrong type": (lambda t, p: _write(t / "m.gguf", p, {"llama.block_count": "two"}),
                                   ["llama.block_count='two' is not allowed"]),
    "a missing metadata key": (lambda t, p: _write(t / "m.gguf", p, {"llama.feed_forward_length": None}),
                               ["missing required metadata key 'llama.feed_forward_length'"]),
    "an unsupported architecture": (
        lambda t, p: _write(t / "m.gguf", ({k.replace("llama.", "mamba."): v for k, v in p[0].items()}, p[1]),
                            arch="mamba"),
        ["unsupported architecture 'mamba'", "llama", "qwen2"]),
    "a missing tensor": (lambda t, p: _write(t / "m.gguf", p, tensors={"blk.1.ffn_up.weight": None}),
                         ["missing tensor 'blk.1.ffn_up.weight'"]),
    "a tensor of the wrong shape": (
        lambda t, p: _write(t / "m.gguf", p, tensors={"blk.0.attn_k.weight": p[1]["blk.0.attn_k.weight"][:16]}),
        ["'blk.0.attn_k.weight'", "[16, 64]", "expected [32, 64]"]),
    "a weight that is not finite": (
        lambda t, p: _write(t / "m.gguf", p, tensors={"blk.0.ffn_up.weight": _nan(p, "blk.0.ffn_up.weight")}),
        ["tensor 'blk.0.ffn_up.weight' holds 1 non-finite"]),
    "an unsupported tokenizer": (lambda t, p: _write(t / "m.gguf", p, {"tokenizer.ggml.model": "bert"}),
                                 ["tokenizer.ggml.model='bert' is not supported"]),
    "no vocabulary": (
        lambda t, p: _write(t / "m.gguf", p, {f"tokenizer.ggml.{k}": None for k in ("tokens", "token_type", "merges")}),
        ["no 'tokenizer.ggml.tokens'"]),
    "a vocabulary SentencePiece refuses": (
        lambda t, p: _write(t / "m.gguf", p, {"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None,
                                              "tokenizer.ggml.tokens": ["a"] * VOCAB}),
        ["SentencePiece refused the vocabulary", "a is already defined"]),
    "a chat template that does not compile": (
        lambda t, p: _write(t / "m.gguf", p, {"tokenizer.chat_template": "{% for %}"}),
        ["chat template: syntax error at line 1"]),
    "a config naming a missing model": (lambda t, p: _config(t, t / "gone.gguf"),
                                        ["no such file, and no bundled model has that name"]),
}


def _args(case: str, tmp: Path, parts) -> tuple[Path, list[str]]:
    """The file the case makes, and how the command line names it."""
    make, _ = CASES[case]
    path = make(tmp, parts)
    return path, (["--config", str(tmp / "model.yaml")] if "config" in case else ["--model", str(path)])


@pytest.mark.parametrize("case", list(CASES))
def test_every_failure_is_one_error_naming_the_file(case, tmp_path, parts, bounded_process):
    path, _ = _args(case, tmp_path, parts)
    with bounded_process(60), pytest.raises(ktquest.GGUFError) as info:  # (bounded: a FIFO must not hang)
        if "config" in case:
            ktquest.load(config=tmp_path / "model.yaml")
        else:
            ktquest.load(path, threads=1)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert all(f in msg for f in CASES[case][1]), msg


@pytest.mark.parametrize("case", list(CASES))
def test_the_command_line_says_each_in_one_line(case, tmp_path, parts, monkeypatch, capsys, bounded_process):
    path, argv = _args(case, tmp_path, parts)
    with bounded_process(60):
        code, out, err = _main(monkeypatch, capsys, [*argv, "--set", "threads=1", "--message", "hi"])
    assert code == 2 and out == ""
    _one_error_line(err, str(path), *CASES[case][1])
