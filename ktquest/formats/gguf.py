"""Read a GGUF file: its metadata as plain Python values and a lazy, dequantizing view of its tensors.

Parsing is done by the ``gguf`` package (``GGUFReader``); this module turns its output into plain Python
values and clear ``GGUFError`` messages that name the file and what is wrong with it. It knows the file
format only: what the tensors and keys mean to a model is ``ktquest.models``' business.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ktquest.formats.errors import GGUFError  # every failure of a model file is one (see there)

GGUF_MAGIC = b"GGUF"


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


_VT = gguf.GGUFValueType
_MAX_ARRAY_DEPTH = 2  # an array of arrays at most (llama.cpp's files have none)
_MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes a value of each type takes: what a count must be checked against before it is looped over.
_ARRAY, _STRING = int(_VT.ARRAY), int(_VT.STRING)  # ints: comparing with enum members is slow in the loop
_MIN_BYTES = {**{int(t): np.dtype(dt).itemsize for t, dt in gguf.GGUFReader.gguf_scalar_to_np.items()},
              _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class _Corrupt(ValueError):
    """A count, length or offset in the file points past its end, or a structure nests too deep."""


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` bounded by the file: every count and length is checked against the bytes left before
    anything is looped over or allocated, so a corrupt header fails at once (an array count of 2**33 in a
    1 KB file made the stock reader loop for minutes at 7 GB), naming the key or tensor. Work and memory
    stay linear in the file's size.

    It also parses a plain ndarray view of its memory map: the reader slices its ``np.memmap`` once per
    metadata value (~250k times for a 49K-token vocabulary with its merges) and numpy's memmap subclass
    makes each slice several times slower, 2x on the whole load. An array of numbers is one view of the
    map (one part, not one per element), which ``ReaderField.contents()`` reads the same way.
    """

    _depth = 0  # arrays being parsed, outermost first
    _last_str: tuple[int, Any] = (-1, b"")  # the last string read: (its end offset, its bytes)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)  # keeps the mapping alive through .base
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if end > len(self.data):
            raise _Corrupt(f"{count} value(s) of {np.dtype(dtype).name} at byte {offset} end at byte {end}, "
                           f"past the end of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        length, data = super()._get_str(offset)
        self._last_str = (offset + 8 + len(data), data)
        return length, data

    def _check_count(self, what: str, count: int, offset: int, min_bytes: int) -> None:
        left = len(self.data) - offset
        if count * min_bytes > left:
            raise _Corrupt(f"{what} is {count}, which needs at least {count * min_bytes} bytes, and only "
                           f"{left} are left in the file")

    def _build_fields(self, offs: int, count: int) -> int:
        self._check_count("the metadata count (kv_count)", int(count), offs, _MIN_KV_BYTES)
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:
        self._check_count("the tensor count", int(count), offs, _MIN_TENSOR_INFO_BYTES)
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if self._depth > 0:
            return self._value_parts(orig_offs, raw_type)
        end, key = self._last_str  # a metadata value follows its key and its type (4 bytes)
        name = str(bytes(key), "utf-8", "replace") if end + 4 == orig_offs else "?"
        try:
            return self._value_parts(orig_offs, raw_type)
        except _Corrupt as e:
            raise _Corrupt(f"metadata key {name[:80]!r}: {e}") from None

    def _value_parts(self, offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != _ARRAY:
            return super()._get_field_parts(offs, raw_type)
        if self._depth >= _MAX_ARRAY_DEPTH:
            raise _Corrupt(f"arrays nested more than {_MAX_ARRAY_DEPTH} deep")
        raw_itype, count = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        itype, n = int(raw_itype[0]), int(count[0])
        if itype not in _MIN_BYTES:
            raise _Corrupt(f"unknown array element type {itype}")
        self._check_count("the array's length", n, offs + 12, _MIN_BYTES[itype])
        types = [_VT.ARRAY, _VT(itype)]
        np_type = self.gguf_scalar_to_np.get(_VT(itype))
        if np_type is not None:  # numbers: one view of the map
            values = self._get(offs + 12, np_type, n)
            return 12 + int(values.nbytes), [raw_itype, count, values], [2], types
        if itype == _STRING:  # the stock reader's parts (length, bytes) per string, sliced here directly
            data, size = self.data, len(self.data)
            order = sys.byteorder if self.byte_order == "I" else {"little": "big", "big": "little"}[sys.byteorder]
            parts: list = [raw_itype, count]
            o = offs + 12
            for _ in range(n):
                k = int.from_bytes(data[o: o + 8], order) if o + 8 <= size else -1
                if k < 0 or o + 8 + k > size:
                    raise _Corrupt(f"string {len(parts) // 2 - 1} of the array runs past the end of the file")
                parts += (data[o: o + 8], data[o + 8: o + 8 + k])
                o += 8 + k
            return o - offs, parts, list(range(3, len(parts), 2)), types
        self._depth += 1
        try:
            return super()._get_field_parts(offs, raw_type)
        finally:
            self._depth -= 1

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:  # what the stock reader would compute for each tensor, checked first
            _, name, n_dims, dims, raw_dtype, offset = field.parts
            what = f"tensor {str(bytes(name), 'utf-8', 'replace')[:80]!r}"
            if not 1 <= int(n_dims[0]) <= _MAX_DIMS:
                raise _Corrupt(f"{what} has {int(n_dims[0])} dimensions (1 to {_MAX_DIMS} are allowed)")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                raise _Corrupt(f"{what} has an unknown type {int(raw_dtype[0])}") from None
            shape = [int(d) for d in dims]
            n = math.prod(shape)
            if min(shape) < 1 or n % block or int(dims[0]) % block:
                raise _Corrupt(f"{what} has shape {shape}, which is not whole blocks of {block} values")
            begin = start_offs + int(offset[0])
            end = begin + n // block * type_size
            if end > len(self.data):
                raise _Corrupt(f"{what} ends at byte {end}, the file has "
                               f"{len(self.data)} bytes")
        super()._build_tensors(start_offs, fields)


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        mode = path.stat().st_mode  # (never opened before it is known to be a file: opening a FIFO waits)
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _NOT_FILES if test(mode)), "not a regular file")
            raise GGUFError(f"{path}: {what}, not a GGUF file")
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except OSError as e:  # a name too long, a link loop, a file it may not read
        raise GGUFError(f"{path}: cannot be read: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return _Reader(path)
    except _Corrupt as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file: {e}") from None
    except OSError as e:  # mapping it
        raise GGUFError(f"{path}: cannot be read: {e.strerror or e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None


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
