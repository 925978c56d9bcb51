"""Where a cache keeps its K/V and which kernels read them: the CPU/device fork, decided in one place.

Every cache (dense, sliding windows, long_context) holds a ``Placement`` made from the engine's device and
dtype and asks it, never the device itself: whether the native kernels read its buffers in place (a CPU
decode step in C++: ``native``), whether torch's fused CPU flash attention takes them (``flash``), and how a
tensor crosses to the DRAM store and back (``to_host`` / ``to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ktquest.kv.attention import FLASH_CPU


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, device: str | torch.device, dtype: torch.dtype) -> Placement:
        return cls(torch.device(device), dtype)

    @property
    def native(self) -> bool:
        """The C++ kernels read and write the buffers in place (numpy views): CPU, fp32."""
        return self.device.type == "cpu" and self.dtype == torch.float32

    @property
    def flash(self) -> bool:
        """torch's fused CPU flash attention, which returns the log-sum-exp, takes the buffers."""
        return self.native and FLASH_CPU is not None

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the store's native calls take it: contiguous on the CPU (no copy where it already is)."""
        return (t if t.device.type == "cpu" else t.cpu()).contiguous()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A result of the store's (CPU) on the cache's device."""
        return t.to(self.device)
