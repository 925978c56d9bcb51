"""tools/make_shaped_gguf.py: the tensors, types and metadata of a shaped GGUF, and the sanity of its random blocks.

The tiny shape is written with the tiny BPE tokenizer of conftest (320 tokens) padded to 384, and read back
with ktquest's GGUF reader; the real shapes are checked through their plans (nothing written).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import finish_gguf

from ktquest.formats.gguf import open_gguf

TOOLS = Path(__file__).resolve().parent.parent / "tools"
Q = gguf.GGMLQuantizationType


def _tool(name: str):
    sys.path.insert(0, str(TOOLS))  # the tool imports its sibling random_blocks
    try:
        spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    return module


@pytest.fixture(scope="module")
def shaped():
    return _tool("make_shaped_gguf")


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory, tiny_bpe) -> Path:
    """A GGUF holding only the tiny BPE tokenizer's keys (what --tokenizer reads)."""
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tiny_bpe.tokens)
    w.add_token_types(tiny_bpe.token_types)
    w.add_token_merges(tiny_bpe.merges)
    w.add_bos_token_id(tiny_bpe.bos_id)
    w.add_eos_token_id(tiny_bpe.eos_id)
    finish_gguf(w)
    return path


def _expected_type(name: str) -> str:
    """The tiny shape's Q4_K_M mix: 256 columns take k-quants; ffn_down's 640 do not (Q4_K -> Q5_0,
    Q6_K -> Q8_0); attn_v and ffn_down get more bits in layers 2 and 3 of 4 (use_more_bits)."""
    if not name.endswith(".weight") or "norm" in name:
        return "F32"
    if name == "token_embd.weight":  # tied: quantized as the output
        return "Q6_K"
    layer = int(name.split(".")[1])
    more = layer >= 2
    if ".attn_v." in name:
        return "Q6_K" if more else "Q4_K"
    if ".ffn_down." in name:
        return "Q8_0" if more else "Q5_0"
    return "Q4_K"


def test_tiny_shape_reads_back(shaped, tokenizer_gguf, tmp_path):
    shape = dataclasses.replace(shaped.SHAPES["tiny"], vocab=384)
    out = tmp_path / "tiny.gguf"
    plans = shaped.write_shaped_gguf(out, shape, "tiny", tokenizer=tokenizer_gguf, context=2048)
    assert not (tmp_path / "tiny.gguf.part").exists()

    f = open_gguf(out)
    md, t = f.metadata, f.tensors
    assert md["general.architecture"] == "qwen2"
    assert md["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert md["qwen2.context_length"] == 2048
    assert md["qwen2.block_count"] == 4 and md["qwen2.embedding_length"] == 256
    assert md["qwen2.attention.head_count"] == 4 and md["qwen2.attention.head_count_kv"] == 2
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 384 and len(set(tokens)) == 384
    assert tokens[320] == "[PAD320]" and set(types[320:]) == {int(gguf.TokenType.UNUSED)}

    names = [p.name for p in plans]
    assert list(t) == names
    assert "output.weight" not in names  # tied embeddings
    layer0 = {n for n in names if n.startswith("blk.0.")}
    assert layer0 == {f"blk.0.{s}" for s in (
        "attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
        "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight")}
    assert t.shape("token_embd.weight") == (384, 256)
    assert t.shape("blk.0.attn_k.weight") == (128, 256) and t.shape("blk.0.attn_k.bias") == (128,)
    assert t.shape("blk.3.ffn_down.weight") == (256, 640) and t.shape("blk.3.ffn_up.weight") == (640, 256)

    embd = t["token_embd.weight"]  # the padding tokens' rows are small (untrained)
    assert 0.018 < float(embd[:320].std()) < 0.022 and float(embd[320:].std()) < 0.003

    for name in names:
        assert t.type_name(name) == _expected_type(name), name
        w = t[name]
        assert np.isfinite(w).all(), name
        if "norm" in name:
            assert abs(float(w.mean()) - 1.0) < 0.05, name
        elif name.endswith(".weight"):
            assert 0.016 < float(w.std()) < 0.024 and abs(float(w.mean())) < 0.003, name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16"])
def test_random_blocks_dequantize_to_the_chosen_std(qtype):
    blocks = _tool("random_blocks")
    rng = np.random.Generator(np.random.SFC64(0))
    data = blocks.random_blocks(Q[qtype], rng, 512, 0.02)
    assert data.dtype == np.uint8 and data.shape == (512, gguf.GGML_QUANT_SIZES[Q[qtype]][1])
    w = gguf.quants.dequantize(data, Q[qtype])
    assert np.isfinite(w).all()
    assert 0.018 < float(w.std()) < 0.022 and abs(float(w.mean())) < 0.002


def test_real_shapes_take_llama_quantize_mix(shaped):
    def types(shape: str, ftype: str = "Q4_K_M") -> dict[str, str]:
        return {p.name: p.qtype.name for p in shaped.plan_tensors(shaped.SHAPES[shape], ftype,
                                                                   shaped.SHAPES[shape].vocab)}

    q7 = types("qwen2.5-7b")  # untied: token_embd keeps the default type, output gets Q6_K
    assert q7["token_embd.weight"] == "Q4_K" and q7["output.weight"] == "Q6_K"
    more = [i for i in range(28) if q7[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert more == [i for i in range(28) if q7[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert {q7[f"blk.{i}.{s}.weight"] for i in range(28) for s in ("attn_q", "attn_k", "ffn_up")} == {"Q4_K"}
    assert q7["blk.0.attn_q.bias"] == "F32"
    plans = {p.name: p for p in shaped.plan_tensors(shaped.SHAPES["qwen2.5-7b"], "Q4_K_M", 152064)}
    assert plans["blk.0.attn_k.weight"].shape == (512, 3584) and plans["blk.0.ffn_down.weight"].shape == (3584, 18944)
    assert 4.6e9 < sum(p.nbytes for p in plans.values()) < 4.7e9  # published Q4_K_M files: 4.68 GB

    q05 = types("qwen2.5-0.5b")  # 896 columns are not whole 256-blocks: llama-quantize's fallbacks
    assert "output.weight" not in q05 and q05["token_embd.weight"] == "Q8_0"
    assert q05["blk.0.attn_q.weight"] == "Q5_0" and q05["blk.0.attn_v.weight"] == "Q8_0"
    assert q05["blk.0.ffn_down.weight"] == "Q6_K" and q05["blk.4.ffn_down.weight"] == "Q4_K"

    llama = types("llama3-8b")
    assert not any(n.endswith(".bias") for n in llama)
    assert set(types("qwen2.5-1.5b", "Q8_0").values()) == {"Q8_0", "F32"}


def test_cli_errors_are_one_line(shaped, tmp_path, capsys):
    with pytest.raises(SystemExit):
        shaped.main(["--shape", "tiny"])
    assert "--out is required" in capsys.readouterr().err
    missing = tmp_path / "nope.gguf"
    assert shaped.main(["--shape", "tiny", "--out", str(tmp_path / "x.gguf"), "--tokenizer", str(missing)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file" in err


def test_qwen3_shapes_take_the_published_files_layout(shaped):
    plans = {p.name: p for p in shaped.plan_tensors(shaped.SHAPES["qwen3-30b-a3b"], "Q4_K_M", 151936)}
    assert plans["blk.0.ffn_gate_inp.weight"].shape == (128, 2048) and plans["blk.0.ffn_gate_inp.weight"].qtype == Q.F32
    assert plans["blk.7.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plans["blk.7.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plans["blk.0.attn_q.weight"].shape == (4096, 2048)  # 32 heads of 128 on a 2048 width
    assert plans["blk.0.attn_output.weight"].shape == (2048, 4096)
    assert plans["blk.0.attn_q_norm.weight"].shape == (128,) and "blk.0.ffn_gate.weight" not in plans
    more = [i for i in range(48) if plans[f"blk.{i}.ffn_down_exps.weight"].qtype == Q.Q6_K]
    assert more == [i for i in range(48) if plans[f"blk.{i}.attn_v.weight"].qtype == Q.Q6_K] and len(more) == 24
    assert {plans[f"blk.{i}.ffn_up_exps.weight"].qtype for i in range(48)} == {Q.Q4_K}
    assert 18.50e9 < sum(p.nbytes for p in plans.values()) < 18.60e9  # published Q4_K_M files: 18.56 GB

    q4 = {p.name: p for p in shaped.plan_tensors(shaped.SHAPES["qwen3-4b-2507"], "Q4_K_M", 151936)}
    assert "output.weight" not in q4 and q4["token_embd.weight"].qtype == Q.Q6_K  # tied
    assert q4["blk.0.attn_k.weight"].shape == (1024, 2560) and not any(n.endswith(".bias") for n in q4)
    assert 2.45e9 < sum(p.nbytes for p in q4.values()) < 2.52e9  # published: 2.50 GB
    q8 = sum(p.nbytes for p in shaped.plan_tensors(shaped.SHAPES["qwen3-8b"], "Q4_K_M", 151936))
    assert 4.98e9 < q8 < 5.06e9  # published: 5.03 GB


def test_tiny_moe_shape_loads_and_decodes(shaped, tokenizer_gguf, tmp_path):
    """The qwen3moe layout as the tool writes it is one ktquest reads: experts, router, QK-norm, head_dim."""
    import ktquest
    from ktquest.config import load_config

    out = tmp_path / "tiny-moe.gguf"
    shape = dataclasses.replace(shaped.SHAPES["tiny-moe"], vocab=384)
    shaped.write_shaped_gguf(out, shape, "tiny-moe", tokenizer=tokenizer_gguf, context=2048)
    md = open_gguf(out).metadata
    assert md["general.architecture"] == "qwen3moe" and md["qwen3moe.expert_count"] == 5
    assert md["qwen3moe.expert_used_count"] == 2 and md["qwen3moe.expert_feed_forward_length"] == 320
    assert md["qwen3moe.attention.key_length"] == 64
    eng = ktquest.load(model=str(out), config=load_config(None, ["threads=1", "max_seq_len=256"]))
    assert eng.args.arch == "qwen3moe" and eng.args.head_dim == 64
    assert [b.n_experts for b in eng.args.blocks] == [5] * 4
    text = eng.generate("hello world", max_new_tokens=4)
    assert isinstance(text, str)


def test_fused_shapes_take_the_converters_layout(shaped):
    """glm4-9b-1m and phi3.5-mini: one attn_qkv (GLM's with its bias), gate | up as one ffn_up, Q5_K qkv in Q4_K_M,
    GLM's ffn_down of 13696 columns on the fallback types; Phi-3's LongRoPE factor tensors [48]."""
    glm = {p.name: p for p in shaped.plan_tensors(shaped.SHAPES["glm4-9b-1m"], "Q4_K_M", 151552)}
    assert glm["blk.0.attn_qkv.weight"].shape == (4096 + 2 * 512, 4096) and glm["blk.0.attn_qkv.weight"].qtype == Q.Q5_K
    assert glm["blk.0.attn_qkv.bias"].shape == (5120,) and "blk.0.attn_q.weight" not in glm
    assert glm["blk.0.ffn_up.weight"].shape == (2 * 13696, 4096) and "blk.0.ffn_gate.weight" not in glm
    assert {glm[f"blk.{i}.ffn_down.weight"].qtype for i in range(40)} == {Q.Q5_0, Q.Q8_0}
    assert 6.2e9 < sum(p.nbytes for p in glm.values()) < 6.4e9  # 9.5B parameters, 5.3 bits each
    phi = {p.name: p for p in shaped.plan_tensors(shaped.SHAPES["phi3.5-mini"], "Q4_K_M", 32064)}
    assert phi["blk.0.attn_qkv.weight"].shape == (3 * 3072, 3072) and "blk.0.attn_qkv.bias" not in phi
    assert phi["rope_factors_long.weight"].shape == (48,) and phi["rope_factors_short.weight"].mean == 1.0
    assert 2.2e9 < sum(p.nbytes for p in phi.values()) < 2.5e9  # 3.8B parameters, 5 bits each


@pytest.mark.parametrize("name", ["glm4-9b-1m", "phi3.5-mini"])
def test_fused_shapes_load_and_decode(shaped, tokenizer_gguf, tmp_path, name):
    """Each fused shape, made small, as the tool writes it is one ktquest reads: the family, the fused tensors,
    the rotated dims, LongRoPE's factors and keys."""
    import ktquest
    from ktquest.config import load_config

    out = tmp_path / f"{name}.gguf"
    shape = dataclasses.replace(shaped.SHAPES[name], dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=320, vocab=384,
                                fused=dataclasses.replace(shaped.SHAPES[name].fused, rope_dim=32))
    shaped.write_shaped_gguf(out, shape, name, tokenizer=tokenizer_gguf)
    md = open_gguf(out).metadata
    arch = shape.arch
    assert md[f"{arch}.rope.dimension_count"] == 32
    assert ("Phi 3" in md["general.name"]) == (arch == "phi3")  # (llama.cpp's phi3 name rule: shaped_glm_phi.py)
    eng = ktquest.load(model=str(out), config=load_config(None, ["threads=1", "max_seq_len=256"]))
    a = eng.args
    assert a.arch == arch and a.n_rot == 32 and all(b.fused_qkv and b.fused_gate_up for b in a.blocks)
    assert all(b.qkv_bias == (arch == "chatglm") for b in a.blocks)
    if arch == "phi3":
        assert a.rope_scaling.type == "longrope" and a.rope_scaling.original_context_length == 4096
        assert md["phi3.rope.scaling.attn_factor"] == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    assert isinstance(eng.generate("hello world", max_new_tokens=4), str)
