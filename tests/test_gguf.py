"""GGUF loading: metadata -> ModelArgs, dequantization of every type, Q/K un-permutation, clear errors."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from conftest import TINY_SPECS, finish_gguf, gguf_metadata, hf_to_gguf_tensors, permute_qk, write_gguf

from ktquest.formats.gguf import GGUFError, dequantize_tensor, open_gguf
from ktquest.models.block import BlockSpec
from ktquest.models.loader import qk_perm, read_gguf

Q = gguf.GGMLQuantizationType


# ---- references: the block formulas of ggml-quants.c for the two types of the bundled model ----


def ref_dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """raw: [rows, n_blocks * 34] uint8; block = f16 scale d, 32 x int8 q; x = d * q."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # [B, 32]
    return (d * q).reshape(raw.shape[0], -1)


def ref_dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """raw: [rows, n_blocks * 20] uint8; block = f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.

    Low nibbles hold elements 0..15, high nibbles 16..31.
    """
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [B, 1]
    qs = blocks[:, 4:]  # [B, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [B, 32]
    return (d * q + m).reshape(raw.shape[0], -1)


# ---- dequantization ----

QUANTIZABLE = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ1_0, Q.TQ2_0, Q.MXFP4]
RAW_ONLY = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
            Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS]


def raw_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Real blocks of ``qtype`` for a [rows, cols] tensor: quantized random data where the gguf package
    can quantize, else random bytes with every fp16 field a sane scale."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    # Random bytes may spell NaN/Inf in the fp16 scales; clear the exponent's top bit of every byte pair
    # that could be one (an odd byte index) so every half-float is finite.
    raw[:, 1::2] &= 0xBF
    return raw


@pytest.mark.parametrize("qtype", [Q.F32] + QUANTIZABLE + RAW_ONLY, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_dequantize_matches_gguf_package(qtype, rows):
    cols = 512  # two 256-blocks, sixteen 32-blocks
    if qtype == Q.F32:
        raw = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    else:
        raw = raw_blocks(qtype, rows, cols)
    got = dequantize_tensor(raw, qtype, "t")
    expected = gguf.quants.dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    assert got.flags.writeable
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got).all()


def test_dequantize_f64():
    raw = np.arange(6, dtype=np.float64).reshape(2, 3)
    got = dequantize_tensor(raw, Q.F64, "t")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, raw)


def test_quantize_roundtrip_is_close():
    """Dequantized values are the data (within each type's quantization error), not just 'equal to gguf'."""
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    for qtype, atol in [(Q.F16, 2e-3), (Q.Q8_0, 0.03), (Q.Q5_0, 0.15), (Q.Q4_1, 0.3)]:
        np.testing.assert_allclose(dequantize_tensor(gguf.quants.quantize(x, qtype), qtype), x, atol=atol)


@pytest.mark.slow
def test_bundled_q8_0_and_q4_1_blocks_match_reference(bundled_gguf):
    c = read_gguf(bundled_gguf)
    for name, qtype, ref in [("token_embd.weight", Q.Q8_0, ref_dequant_q8_0),
                             ("blk.0.attn_q.weight", Q.Q4_1, ref_dequant_q4_1)]:
        t = c.tensors.raw(name)
        assert t.tensor_type == qtype
        raw = np.asarray(t.data[:8])  # the first 8 rows' blocks
        np.testing.assert_array_equal(dequantize_tensor(raw, qtype, name), ref(raw))


def test_unsupported_type_is_named(tmp_path):
    raw = np.zeros((2, 32 // 32 * 40), dtype=np.uint8)  # one Q8_1 block per row
    with pytest.raises(GGUFError, match=r"'w'.*Q8_1"):
        dequantize_tensor(raw, Q.Q8_1, "w", "x.gguf")


def test_every_type_through_a_file(tmp_path):
    """Tensors of many types written with GGUFWriter come back dequantized with their shapes."""
    spec = TINY_SPECS["llama_tied"]
    from conftest import build_hf_model

    hf = build_hf_model(spec, vocab_size=64)
    tensors = hf_to_gguf_tensors(hf, spec)
    extras = {f"extra.{t.name}": raw_blocks(t, 2, 256, seed=i) for i, t in enumerate(QUANTIZABLE + RAW_ONLY)}
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for k, v in gguf_metadata(spec, 64).items():
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    for (name, raw), qtype in zip(extras.items(), QUANTIZABLE + RAW_ONLY, strict=True):
        if raw.dtype == np.uint8:
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:  # F16 and BF16 come back from quantize() as 2-byte elements
            w.add_tensor(name, raw.view(np.uint8) if qtype == Q.BF16 else raw,
                         raw_dtype=Q.BF16 if qtype == Q.BF16 else None)
    finish_gguf(w)

    c = read_gguf(path)
    for (name, raw), qtype in zip(extras.items(), QUANTIZABLE + RAW_ONLY, strict=True):
        assert c.tensors.type_name(name) == qtype.name
        assert c.tensors.shape(name) == (2, 256)
        np.testing.assert_array_equal(c.tensors[name], gguf.quants.dequantize(raw, qtype))


# ---- metadata and layout ----


def test_tiny_llama_args_and_metadata(tiny_llama, tiny_bpe):
    c = read_gguf(tiny_llama.path)
    a, spec = c.args, TINY_SPECS["llama"]
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim) == \
        ("llama", spec.n_layers, spec.dim, spec.n_heads, spec.n_kv_heads, spec.dim // spec.n_heads, spec.ffn)
    assert (a.vocab_size, a.context_length, a.rope_scaling, a.blocks[0].qkv_bias, a.tie_embeddings) == \
        (len(tiny_bpe.tokens), spec.ctx, None, False, False)
    assert a.norm_eps == pytest.approx(spec.eps) and a.rope_theta == spec.rope_theta
    md = c.metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt2"
    assert md["tokenizer.ggml.tokens"] == tiny_bpe.tokens and md["tokenizer.ggml.merges"] == tiny_bpe.merges
    assert md["tokenizer.ggml.token_type"] == tiny_bpe.token_types
    assert md["tokenizer.ggml.eos_token_id"] == 2 and md["tokenizer.ggml.add_bos_token"] is False
    assert isinstance(md["tokenizer.chat_template"], str)
    assert not any(k.startswith("GGUF.") for k in md)


def test_qwen2_args(tiny_qwen2):
    a = read_gguf(tiny_qwen2.path).args
    assert a.arch == "qwen2" and all(b.qkv_bias for b in a.blocks) and a.tie_embeddings


def test_rope_scaling_args(tiny_models):
    linear = read_gguf(tiny_models("llama_linear").path).args.rope_scaling
    assert (linear.type, linear.factor, linear.freq_factors) == ("linear", 2.0, None)
    yarn = read_gguf(tiny_models("qwen2_yarn").path).args.rope_scaling
    assert (yarn.type, yarn.factor, yarn.original_context_length) == ("yarn", 4.0, 64)
    llama3 = read_gguf(tiny_models("llama3").path).args.rope_scaling
    assert llama3.type == "llama3" and len(llama3.freq_factors) == 8 and max(llama3.freq_factors) == 8.0


@pytest.mark.parametrize("n_heads,n_kv_heads", [(1, 1), (3, 1), (4, 2)])
def test_qk_perm_inverts_the_converter(n_heads, n_kv_heads):
    """The gather the model applies to a llama file's q | k | v projection undoes the converter's permutation
    of q and k (per head) and leaves v."""
    d = 8
    a = SimpleNamespace(permuted_qk=True, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=d, rope_dim=0,
                        blocks=(BlockSpec(),))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((h * d, 5)).astype(np.float32) for h in (n_heads, n_kv_heads, n_kv_heads))
    in_file = np.concatenate([permute_qk(q, n_heads), permute_qk(k, n_kv_heads), v])
    np.testing.assert_array_equal(in_file[qk_perm(a).numpy()], np.concatenate([q, k, v]))
    assert qk_perm(SimpleNamespace(permuted_qk=False, rope_dim=0, blocks=(BlockSpec(),))) is None


# ---- bad inputs: GGUFError names the file and the problem (every way a file fails, through ktquest.load and
# the command line: test_model_files.py) ----


def _tiny_parts(name: str = "llama") -> tuple[str, dict, dict]:
    from conftest import build_hf_model

    spec = TINY_SPECS[name]
    return spec.arch, gguf_metadata(spec, 64), hf_to_gguf_tensors(build_hf_model(spec, 64), spec)


def _assert_error(path: Path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg


def test_missing_qwen2_bias(tmp_path):
    arch, md, tensors = _tiny_parts("qwen2")
    del tensors["blk.0.attn_k.bias"]
    path = write_gguf(tmp_path / "nobias.gguf", arch, md, tensors, None)
    _assert_error(path, "missing tensor 'blk.0.attn_k.bias'")


def test_unsupported_rope_scaling(tmp_path):
    arch, md, tensors = _tiny_parts()
    md["llama.rope.scaling.type"] = "longrope"
    path = write_gguf(tmp_path / "longrope.gguf", arch, md, tensors, None)
    _assert_error(path, "longrope", "supported")


def test_unreadable_tensor_type_fails_on_access(tmp_path):
    arch, md, tensors = _tiny_parts()
    path = tmp_path / "q8_1.gguf"
    w = gguf.GGUFWriter(path, arch)
    for k, v in md.items():
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.add_tensor("odd.weight", np.zeros((2, 40), dtype=np.uint8), raw_shape=(2, 40), raw_dtype=Q.Q8_1)
    finish_gguf(w)
    c = read_gguf(path)
    with pytest.raises(GGUFError, match=r"'odd.weight' has type Q8_1"):
        c.tensors["odd.weight"]


# ---- a bounded reader: counts and lengths checked against the bytes left ----


METADATA_KINDS = {  # key -> (value, GGUFWriter method): every value type, arrays of each, an array of arrays
    "t.u8": (200, "add_uint8"), "t.i8": (-5, "add_int8"), "t.u16": (60000, "add_uint16"),
    "t.i16": (-300, "add_int16"), "t.u32": (4_000_000_000, "add_uint32"), "t.i32": (-7, "add_int32"),
    "t.u64": (2**63 + 5, "add_uint64"), "t.i64": (-(2**40), "add_int64"), "t.f32": (0.5, "add_float32"),
    "t.f64": (1e300, "add_float64"), "t.bool": (True, "add_bool"), "t.str": ("héllo", "add_string"),
    "t.empty_str": ("", "add_string"), "t.ints": ([1, 2, 3], "add_array"), "t.floats": ([0.25, -1.5], "add_array"),
    "t.strs": (["a", "", "ünï"], "add_array"), "t.bools": ([True, False], "add_array"),
    "t.nested": ([[1, 2], [3]], "add_array"),
}


def _write_small(path: Path, metadata: dict, endianess=gguf.GGUFEndian.LITTLE,
                 tensors: dict | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    for key, (value, method) in metadata.items():
        getattr(w, method)(key, value)
    for name, t in (tensors if tensors is not None else {"w": np.ones((2, 32), np.float32)}).items():
        w.add_tensor(name, t)
    finish_gguf(w)
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["le", "be"])
def test_metadata_is_what_the_stock_reader_reads(tmp_path, endianess):
    path = _write_small(tmp_path / "kinds.gguf", METADATA_KINDS, endianess)
    stock = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in stock.fields.items() if not k.startswith("GGUF.")}
    md = open_gguf(path).metadata
    assert md == expected
    assert md["t.strs"] == ["a", "", "ünï"] and md["t.u64"] == 2**63 + 5 and md["t.ints"] == [1, 2, 3]


def _key_offset(data: bytes, key: str) -> int:
    """Where the value type of metadata ``key`` starts (little-endian files)."""
    k = key.encode()
    return data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)


def _patched(tmp_path: Path, data: bytes, at: int, fmt: str, value: int) -> Path:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(b))
    return path


def _assert_open_error(path: Path, *fragments: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        open_gguf(path)
    msg = str(info.value)
    assert time.perf_counter() - t0 < 2 and "\n" not in msg, msg
    assert all(f in msg for f in (str(path), *fragments)), msg


@pytest.mark.parametrize("key", ["t.ints", "t.strs", "t.bools", "t.nested"])
@pytest.mark.parametrize("count", [2**33, 2**64 - 1, 10**6])
def test_array_count_past_the_end_names_the_key(tmp_path, key, count):
    data = _write_small(tmp_path / "a.gguf", METADATA_KINDS).read_bytes()
    path = _patched(tmp_path, data, _key_offset(data, key) + 8, "<Q", count)  # type u32, item type u32, count
    _assert_open_error(path, f"metadata key {key!r}", f"the array's length is {count}", "bytes")


@pytest.mark.parametrize("key", ["t.str", "general.architecture"])
def test_string_length_past_the_end(tmp_path, key):
    data = _write_small(tmp_path / "a.gguf", METADATA_KINDS).read_bytes()
    path = _patched(tmp_path, data, _key_offset(data, key) + 4, "<Q", 2**62)
    _assert_open_error(path, "truncated or corrupt", "past the end of the file")


def test_string_in_an_array_past_the_end(tmp_path):
    data = _write_small(tmp_path / "a.gguf", METADATA_KINDS).read_bytes()
    path = _patched(tmp_path, data, _key_offset(data, "t.strs") + 16, "<Q", 2**40)  # the first string's length
    _assert_open_error(path, "metadata key 't.strs'", "string 0 of the array runs past the end")


def test_arrays_nested_too_deep(tmp_path):
    path = _write_small(tmp_path / "deep.gguf", {"t.deep": ([[[1]]], "add_array")})
    _assert_open_error(path, "metadata key 't.deep'", "nested more than 2 deep")


@pytest.mark.parametrize("field, at, fmt, value, needle", [
    ("tensor count", 8, "<Q", 2**40, "the tensor count is 1099511627776"),
    ("kv count", 16, "<Q", 2**40, "the metadata count (kv_count) is 1099511627776"),
])
def test_header_counts_past_the_end(tmp_path, field, at, fmt, value, needle):
    data = _write_small(tmp_path / "a.gguf", {}).read_bytes()
    _assert_open_error(_patched(tmp_path, data, at, fmt, value), needle)


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Where tensor ``name``'s n_dims field starts."""
    n = name.encode()
    return data.index(struct.pack("<Q", len(n)) + n) + 8 + len(n)


@pytest.mark.parametrize("at, fmt, value, needle", [
    (0, "<I", 9, "tensor 'w' has 9 dimensions"),
    (0, "<I", 0, "tensor 'w' has 0 dimensions"),
    (4, "<Q", 2**62, "tensor 'w' ends at byte"),  # dims[0] (its overflowing product once wrapped to a small number)
    (12, "<Q", 2**62 + 1, "tensor 'w' ends at byte"),
    (12, "<Q", 0, "tensor 'w' has shape [32, 0]"),
    (20, "<I", 1000, "tensor 'w' has an unknown type 1000"),
    (24, "<Q", 2**50, "tensor 'w' ends at byte"),  # its data offset
])
def test_tensor_info_out_of_range_names_the_tensor(tmp_path, at, fmt, value, needle):
    data = _write_small(tmp_path / "a.gguf", {}).read_bytes()
    _assert_open_error(_patched(tmp_path, data, _tensor_info_offset(data, "w") + at, fmt, value), needle)
