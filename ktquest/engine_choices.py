"""What a config's ``auto`` choices resolve to for one engine: the device, the compute dtype, how the weights are
kept (in their GGUF encoding or dequantized) and the activations' integer width (``Engine.__init__``)."""

from __future__ import annotations

import torch

from ktquest.config import ConfigError


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not allowed: CUDA is not available to torch "
                          f"{torch.__version__}; use 'cpu' or 'auto'")
    return torch.device(name)


def pick_activations(name: str, args) -> str:
    """"int8" or "int16" (Config.activations): auto = int16 under 1B parameters."""
    if name != "auto":
        return name
    return "int16" if args.n_params < ACTIVATIONS_INT16_BELOW else "int8"


ACTIVATIONS_INT16_BELOW = 1_000_000_000  # parameters


def pick_weights(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"gguf", "dequantize" or "int8" (Config.weights; on a GPU ``kv.memory.choose_weights`` may turn an auto
    "dequantize" into "int8"); ConfigError for gguf off the CPU or not in float32."""
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        return "gguf" if cpu_fp32 else "dequantize"
    if name == "gguf" and not cpu_fp32:
        raise ConfigError(f"weights: gguf runs on the CPU in float32, not on {device.type} in "
                          f"{str(dtype).removeprefix('torch.')} (use weights: dequantize)")
    return name


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
