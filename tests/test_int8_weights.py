"""Weights as int8 rows (``weights: int8``, layers/linear.Int8Weight): where CUDA takes them instead of fp16,
what the engine holds, and the product's numbers."""

from __future__ import annotations

import pytest
import torch

import ktquest
from ktquest.config import Config, ConfigError


def test_weights_on_cuda_are_fp16_where_they_fit_else_int8_else_refused_up_front(tiny_llama, monkeypatch):
    """CUDA holds the weights in fp16 where they fit the free device memory, else (auto) as int8 rows, said with
    the memory they take; where neither fits, or the form asked does not, the model is refused before any
    weight is read, with the figures (checked here without a GPU)."""
    import ktquest.kv.memory as memory
    from ktquest.models.loader import read_gguf

    args = read_gguf(tiny_llama.path).args
    cuda = torch.device("cuda")
    full, int8 = args.n_params * 2, memory.int8_weight_bytes(args, torch.float16)
    assert args.n_params < int8 < full * 0.52

    def free(n):
        monkeypatch.setattr(memory, "available_memory", lambda d: (n, "is free on cuda:0"))

    free(full)
    assert memory.choose_weights("auto", "dequantize", args, cuda, torch.float16) == (
        "dequantize", f"weights: float16 on cuda, {full / 2**20:.1f} MiB ({full / 2**20:.1f} MiB is free on cuda:0)")
    free(full - 1)
    kind, note = memory.choose_weights("auto", "dequantize", args, cuda, torch.float16)
    assert kind == "int8" and note.startswith(f"weights: int8 rows on cuda, {int8 / 2**20:.1f} MiB (in float16 "
                                              f"they would need {full / 2**20:.1f} MiB;")
    with pytest.raises(ConfigError, match=rf"^the model's weights in float16 would need {full / 2**20:.1f} MiB .*"
                                          rf"; weights: int8 would need {int8 / 2**20:.1f} MiB; run it on the CPU"):
        memory.choose_weights("dequantize", "dequantize", args, cuda, torch.float16)  # asked: not turned to int8
    free(int8 - 1)
    with pytest.raises(ConfigError, match=rf"^the model's weights as int8 rows would need "
                                          rf"{int8 / 2**20:.1f} MiB .* is free on cuda:0; run it on the CPU"):
        memory.choose_weights("int8", "int8", args, cuda, torch.float16)
    with pytest.raises(ConfigError, match=rf"^the model's weights in float16 would need {full / 2**20:.1f} MiB, as "
                                          rf"int8 rows {int8 / 2**20:.1f} MiB, .* is free on cuda:0; run it on"):
        memory.choose_weights("auto", "dequantize", args, cuda, torch.float16)
    assert memory.choose_weights("auto", "gguf", args, torch.device("cpu"), torch.float32)[0] == "gguf"


def test_int8_weights_are_refused_for_a_model_with_experts(tiny_models):
    """An MoE model's experts' stacks stay whole: weights: int8 is refused for it by name, on any device, and
    auto keeps fp16 on a GPU (refused with its figure where that does not fit)."""
    import ktquest.kv.memory as memory
    from ktquest.models.loader import read_gguf

    path = tiny_models("qwen3moe").path
    args = read_gguf(path).args
    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match="^weights: int8 is for a model without experts"):
            memory.choose_weights("int8", "int8", args, torch.device(device), torch.float16)
    with pytest.raises(ConfigError, match="weights: int8 is for a model without experts"):
        ktquest.load(path, Config(weights="int8", max_seq_len=256))


def test_int8_weights_hold_every_matrix_as_int8_rows(tiny_llama, tiny_qwen2):
    """weights: int8 (here on the CPU): every matrix, the embedding table too, int8 rows with a scale a row;
    the logits stay close to the dequantized model's and the greedy text mostly agrees."""
    from ktquest.layers.linear import Linear

    for tiny in (tiny_llama, tiny_qwen2):  # (qwen2: Q/K/V biases, tied embeddings)
        ref = ktquest.load(tiny.path, Config(weights="dequantize", max_seq_len=256))
        eng = ktquest.load(tiny.path, Config(weights="int8", max_seq_len=256))
        assert eng.weights == "int8" and eng.weights_note.startswith("weights: int8 rows on cpu, ")
        linears = [m for m in eng.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.w8.dtype == torch.int8 and m.weight is None for m in linears)
        assert eng.model.tok_embeddings.w8.dtype == torch.int8
        prompt = torch.tensor(eng.tokenizer.encode("the quick brown fox jumps over the lazy dog"))
        want = ref.model(prompt, 0, ktquest.engine.make_cache(ref.config, ref.args, 256, ref.device, ref.dtype))
        got = eng.model(prompt, 0, ktquest.engine.make_cache(eng.config, eng.args, 256, eng.device, eng.dtype))
        assert float((got - want).abs().max() / want.abs().max()) < 0.05
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.8


def test_an_int8_product_in_fp16_does_not_overflow_where_the_true_one_fits():
    """The int8 rows are scaled before the product (in panels): an fp16 output of 410 stays finite, where the
    unscaled product (127 / 0.5 times larger) would not."""
    from ktquest.layers import linear
    from ktquest.layers.linear import Int8Weight, Linear

    w = torch.full((3, 1024), 0.5, dtype=torch.float16)
    lin = Linear(Int8Weight.of(w))
    x = torch.full((1, 1024), 0.8, dtype=torch.float16)
    want = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(lin(x).float(), want, rtol=2e-3, atol=0)
    old = linear.INT8_PANEL
    try:
        linear.INT8_PANEL = 1024  # a panel a row: the same product
        torch.testing.assert_close(lin(x).float(), want, rtol=2e-3, atol=0)
    finally:
        linear.INT8_PANEL = old
