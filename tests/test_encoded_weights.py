"""A model whose weights stay in their GGUF encoding (``weights: gguf``): the same greedy tokens as the
dequantize-everything reference path, weights that are views of the mapped file, rarer types converted to
Q8_0, and bad block data refused naming the tensor."""

from __future__ import annotations

import dataclasses
import mmap

import gguf
import numpy as np
import pytest
import torch
from conftest import finish_gguf
from test_make_shaped_gguf import _tool, tokenizer_gguf  # noqa: F401 (a fixture)

import ktquest
from ktquest.config import ConfigError
from ktquest.formats.gguf import GGUFError
from ktquest.layers.linear import Linear
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder


@pytest.fixture(scope="module")
def shaped_tiny(tmp_path_factory, tokenizer_gguf):  # noqa: F811
    """The tiny shape of tools/make_shaped_gguf.py: qwen2 with biases, Q4_K_M (Q4_K, Q6_K, F32), tied."""
    shaped = _tool("make_shaped_gguf")
    out = tmp_path_factory.mktemp("shaped") / "tiny.gguf"
    shape = dataclasses.replace(shaped.SHAPES["tiny"], vocab=384)
    shaped.write_shaped_gguf(out, shape, "tiny", tokenizer=tokenizer_gguf, context=2048)
    return out


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_shaped_model_greedy_tokens_match_the_dequantized_reference(shaped_tiny, activations):
    ref = ktquest.load(shaped_tiny, weights="dequantize", max_seq_len=256, chunk_size=16)
    enc = ktquest.load(shaped_tiny, weights="gguf", activations=activations, max_seq_len=256, chunk_size=16)
    assert isinstance(enc.model.decoder, NativeDecoder) and isinstance(ref.model.decoder, TorchDecoder)
    texts = [eng.generate("the cat sat on the mat and then", max_new_tokens=24, temperature=0)
             for eng in (ref, enc)]
    assert texts[0] == texts[1] and len(texts[0]) > 0


def test_weights_are_views_of_the_mapped_file(shaped_tiny):
    """No fp32 copy of a linear layer: every matrix's bytes lie in the file's mapping; the only fp32 tensors
    are the norms and biases (a few KB)."""
    model, contents = load_model(shaped_tiny, encoded=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.quant is not None for m in linears)
    size = shaped_tiny.stat().st_size
    for m in linears:
        for _, data in m.quant.parts:
            base = data
            while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
                base = base.base
            assert isinstance(base, mmap.mmap) and len(base) == size
            assert not data.flags.writeable
    assert model.tok_embeddings.quant is model.output.quant  # tied: one mapping
    vectors = sum(p.nbytes for p in model.parameters())
    matrices = sum(m.quant.nbytes for m in linears)
    assert vectors < matrices / 20


def _copy_with(src, dst, rewrite):
    """dst: src's tensors through ``rewrite(name, array, type) -> (array, type)``, every key kept."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    for t in reader.tensors:
        data, qtype = rewrite(t.name, np.array(t.data), t.tensor_type)
        w.add_tensor(t.name, data, raw_shape=data.shape if qtype == gguf.GGMLQuantizationType.F32 else None,
                     raw_dtype=qtype)
    finish_gguf(w)


def test_a_type_without_kernels_is_converted_to_q8_0(shaped_tiny, tmp_path, capsys):
    """Q3_K (no kernels) becomes Q8_0 once at load, said on stderr; the model then answers as the reference."""
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "q3k.gguf"
    rng = np.random.default_rng(0)

    def rewrite(name, data, qtype):
        if name == "blk.1.ffn_up.weight":
            rows = data.shape[0]
            bv, bb = gguf.GGML_QUANT_SIZES[Q.Q3_K]
            cols = data.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
            blocks = rng.integers(0, 256, (rows * cols // bv, bb), dtype=np.uint8)
            blocks[:, -2:] = np.full(len(blocks), 0.01, np.float16).view(np.uint8).reshape(-1, 2)  # d
            return blocks.reshape(rows, -1), Q.Q3_K
        return data, qtype

    _copy_with(shaped_tiny, path, rewrite)
    capsys.readouterr()
    model, _ = load_model(path, encoded=True)
    assert "1 tensor(s) of a type with no kernels converted to Q8_0 at load (Q3_K)" in capsys.readouterr().err
    up = model.layers[1].ffn.w_gate_up.quant
    assert [t for t, _ in up.parts] == ["Q4_K", "Q8_0"]
    ref, _ = load_model(path)  # dequantized from Q3_K: the Q8_0 rounding is all that differs
    w_ref = ref.layers[1].ffn.w_gate_up.weight.numpy()
    np.testing.assert_allclose(up.dequantize(), w_ref, atol=0.01 * float(np.abs(w_ref).max()))


def test_bad_block_data_names_the_tensor(shaped_tiny, tmp_path):
    """A non-finite block scale, and a file cut inside the tensor data: GGUFError naming the tensor."""
    path = tmp_path / "nan.gguf"

    def rewrite(name, data, qtype):
        if name == "blk.2.attn_output.weight":
            data = data.copy()
            data.reshape(-1, 144)[5, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # block 5's d
        return data, qtype

    _copy_with(shaped_tiny, path, rewrite)
    with pytest.raises(GGUFError, match=r"tensor 'blk.2.attn_output.weight' holds 1 non-finite Q4_K block scales"):
        load_model(path, encoded=True)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(shaped_tiny.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match=r"truncated or corrupt GGUF file: tensor '[^']+' .*ends at byte"):
        load_model(cut, encoded=True)


def test_a_type_neither_kernels_nor_gguf_can_read_names_the_tensor(shaped_tiny, tmp_path):
    """Q8_1 (an activation format, no dequantizer in the gguf package) as a weight: GGUFError naming the tensor
    and its type, before the model is built."""
    Q = gguf.GGMLQuantizationType
    path = tmp_path / "q8_1.gguf"

    def rewrite(name, data, qtype):
        if name == "blk.0.ffn_gate.weight":
            cols = data.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
            bv, bb = gguf.GGML_QUANT_SIZES[Q.Q8_1]
            return np.zeros((data.shape[0], cols // bv * bb), np.uint8), Q.Q8_1
        return data, qtype

    _copy_with(shaped_tiny, path, rewrite)
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_gate.weight' has type Q8_1, which cannot be dequantized"):
        load_model(path, encoded=True)


def test_gguf_weights_need_the_cpu_in_float32(shaped_tiny):
    with pytest.raises(ConfigError, match="weights: gguf runs on the CPU in float32"):
        ktquest.load(shaped_tiny, weights="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="run on the CPU in float32"):
        load_model(shaped_tiny, encoded=True, dtype=torch.float16)
