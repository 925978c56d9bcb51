"""Read a GGUF file: its metadata as plain Python values and a lazy, dequantizing view of its tensors.

Parsing is done by the ``gguf`` package (``GGUFReader``); this module turns its output into plain Python
values and clear ``GGUFError`` messages that name the file and what is wrong with it. It knows the file
format only: what the tensors and keys mean to a model is ``ktquest.models``' business.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file is not a GGUF model this runtime can load; the message names the file and the problem."""


# ---- tensors ----


def dequantize_tensor(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, name: str = "?",
                      path: str | os.PathLike = "?") -> np.ndarray:
    """Raw GGUF tensor data (as ``GGUFReader`` maps it) -> a new, writable float32 array [rows, cols].

    Covers every type ``gguf.quants`` can dequantize (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ*, TQ*,
    MXFP4, ...) plus F64; anything else raises ``GGUFError`` naming the tensor and its type.
    """
    qtype = gguf.GGMLQuantizationType(ggml_type)
    if qtype == gguf.GGMLQuantizationType.F64:
        return np.asarray(data, dtype=np.float64).astype(np.float32)
    try:
        out = gguf.quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {name!r} has type {qtype.name}, which cannot be dequantized "
                        f"(the gguf package has no dequantizer for it)") from None
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.array(out, dtype=np.float32)  # a copy: F32 comes back as a view of the read-only map
    return out.astype(np.float32, copy=False)


class GGUFTensors(Mapping):
    """name -> float32 ndarray, dequantized on each access (nothing is kept); shapes are [rows, cols]."""

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self._path = path
        self._by_name = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._by_name[name]
        return dequantize_tensor(t.data, t.tensor_type, name, self._path)

    def __contains__(self, name: object) -> bool:  # Mapping's default would dequantize the tensor
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def raw(self, name: str) -> gguf.ReaderTensor:
        """The tensor as the file stores it: ``.data`` (its blocks, memory-mapped), ``.tensor_type``."""
        return self._by_name[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """[rows, cols] (numpy / torch order: GGUF's dims reversed)."""
        return tuple(int(d) for d in reversed(self._by_name[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self._by_name[name].tensor_type.name


@dataclass(slots=True)
class GGUFFile:
    """What ``open_gguf`` found.

    ``metadata`` holds every key/value of the file under its GGUF key, as plain Python values
    (str, int, float, bool, list[str], list[int], list[float]). The tokenizer keys, when present:

    - ``tokenizer.ggml.model`` (str: "gpt2" = byte-level BPE, "llama" = SentencePiece)
    - ``tokenizer.ggml.pre`` (str: pre-tokenizer name, e.g. "smollm", "qwen2", "llama-bpe")
    - ``tokenizer.ggml.tokens`` (list[str]), ``tokenizer.ggml.scores`` (list[float]),
      ``tokenizer.ggml.token_type`` (list[int]: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)
    - ``tokenizer.ggml.merges`` (list[str], "a b")
    - ``tokenizer.ggml.bos_token_id``, ``eos_token_id``, ``eot_token_id``, ``unknown_token_id``,
      ``padding_token_id`` (int)
    - ``tokenizer.ggml.add_bos_token``, ``add_eos_token``, ``add_space_prefix`` (bool)
    - ``tokenizer.chat_template`` (str, Jinja)
    """

    path: Path
    tensors: GGUFTensors  # the file's layout (llama Q/K rows still permuted: see models/loader.py)
    metadata: dict[str, Any]


# ---- reading ----


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):  # defensive: contents() already returns Python scalars
        value = value.item()
    return value


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` parsing a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per metadata value (~250k times for a 49K-token vocabulary
    with its merges) and numpy's memmap subclass makes each slice several times slower: 2x on the whole load.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)  # keeps the mapping alive through .base
        return super()._get(offset, dtype, count, override_order)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                            f"{t.data_offset + t.n_bytes}, the file has {size} bytes")
    return reader


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path``'s header: metadata and a lazy view of the tensors (nothing is dequantized yet)."""
    path = Path(path)
    reader = _open_reader(path)
    try:
        metadata = {name: _field_value(f) for name, f in reader.fields.items()
                    if not name.startswith("GGUF.")}  # GGUF.version etc.: the reader's own bookkeeping
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: corrupt metadata ({type(e).__name__}: {e})") from None
    return GGUFFile(path=path, tensors=GGUFTensors(path, reader), metadata=metadata)
