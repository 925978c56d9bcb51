"""KV files: a conversation's KV cache on disk, so a long document is read once and asked about many times.

Layout (little-endian)::

    b"KTQKV\\0" u16 format       magic and format version
    u64 n                        header bytes
    header                       n bytes of JSON: what was saved (tokens, the cache's scalars, the fingerprint
                                 of the model file and of the config keys that shape the cache) and the table of
                                 arrays: name, dtype, shape, offset, bytes, crc32
    u32 crc32(header)
    arrays                       each at a 64-byte aligned offset from the start of the file

Written atomically (a temporary file in the same directory, fsync, rename): a reader never sees half a file.
Read by memory-mapping the file (copy-on-write: nothing is read twice, nothing written back); every size is
checked against the file's before anything is used, the header's checksum first and each array's checksum
before it is copied into the cache, so a truncated or corrupted file is a ``KVFileError`` naming what is
wrong, and the cache it was to fill is left empty, never half-filled or silently wrong.

What each cache keeps is its own: ``state()`` -> (scalars, arrays), ``state_shapes(scalars)`` (what a file's
arrays must be, or ``KVFileError``), ``load_state(scalars, arrays)``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch

MAGIC = b"KTQKV\0"
FORMAT = 1
ALIGN = 64
MAX_HEADER = 256 << 20  # a header past this is corruption, not a conversation
_PREFIX = struct.Struct("<6sHQ")  # magic, format, header bytes
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
           "int32": torch.int32, "int64": torch.int64}


class KVFileError(ValueError):
    """A KV file that cannot be used here: unreadable, truncated, corrupted, or from another model or config."""


def save(path: str | os.PathLike, header: dict, arrays: dict[str, torch.Tensor]) -> int:
    """Write ``header`` (JSON-able) and ``arrays`` to ``path`` atomically; returns the file's bytes."""
    path = Path(path)
    table, offset = [], 0
    tensors = {}
    for name, t in arrays.items():
        t = t.detach().to("cpu").contiguous()
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"KV file: array {name} of dtype {t.dtype} cannot be saved")
        offset = -(-offset // ALIGN) * ALIGN
        raw = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else memoryview(b"")
        tensors[name] = (offset, raw)
        table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "bytes": t.numel() * t.element_size(), "crc32": zlib.crc32(raw)})
        offset += t.numel() * t.element_size()
    head = json.dumps({**header, "arrays": table, "payload_bytes": offset}, separators=(",", ":")).encode()
    start = -(-(_PREFIX.size + len(head) + 4) // ALIGN) * ALIGN
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT, len(head)) + head + struct.pack("<I", zlib.crc32(head)))
            for name, (off, raw) in tensors.items():
                f.seek(start + off)
                f.write(raw)
            f.truncate(start + offset)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return start + offset


def load(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and the arrays of a KV file (views of a copy-on-write mapping, checksums checked)."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - the mapping outlives the with block
    except OSError as e:
        raise KVFileError(f"{path}: cannot open the KV file: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREFIX.size + 4:
            raise KVFileError(f"{path}: not a KV file ({size} bytes, too short for the header)")
        magic, fmt, n = _PREFIX.unpack(f.read(_PREFIX.size))
        if magic != MAGIC:
            raise KVFileError(f"{path}: not a KV file (it does not start with {MAGIC!r})")
        if fmt != FORMAT:
            raise KVFileError(f"{path}: KV file format {fmt}; this ktquest reads format {FORMAT}")
        if n > min(MAX_HEADER, size - _PREFIX.size - 4):
            raise KVFileError(f"{path}: truncated or corrupted: its header says {n:,} bytes, the file has {size:,}")
        head = f.read(n)
        (crc,) = struct.unpack("<I", f.read(4))
        if zlib.crc32(head) != crc:
            raise KVFileError(f"{path}: corrupted: the header's checksum does not match")
        try:
            header = json.loads(head)
            table, payload = header["arrays"], int(header["payload_bytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise KVFileError(f"{path}: corrupted header ({e})") from None
        start = -(-(_PREFIX.size + n + 4) // ALIGN) * ALIGN
        if size != start + payload:
            raise KVFileError(f"{path}: truncated or corrupted: {size:,} bytes, the header says {start + payload:,}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    arrays = {}
    for a in table if isinstance(table, list) else [None]:
        try:
            name, dtype, shape, off, nbytes = a["name"], _DTYPES.get(a["dtype"]), a["shape"], a["offset"], a["bytes"]
            ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and \
                type(off) is int and type(nbytes) is int and type(a["crc32"]) is int
            count = 1
            for d in shape if ok else ():
                count *= d
        except (KeyError, TypeError):
            raise KVFileError(f"{path}: corrupted header (its table of arrays)") from None
        if not ok or dtype is None or off < 0 or off + nbytes > payload or count * dtype.itemsize != nbytes:
            raise KVFileError(f"{path}: corrupted: array {name} ({a['dtype']} {shape}) does not fit its bytes")
        view = memoryview(mm)[start + off: start + off + nbytes]
        if zlib.crc32(view) != a["crc32"]:
            raise KVFileError(f"{path}: corrupted: the checksum of array {name} does not match")
        arrays[name] = torch.frombuffer(view, dtype=dtype, count=count).reshape(shape) if count else \
            torch.empty(shape, dtype=dtype)
    return header, arrays


def expect(path, arrays: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> None:
    """KVFileError unless ``arrays`` are exactly the names, shapes and dtypes of ``shapes`` (name -> (shape,
    dtype)): what a cache's ``state_shapes`` says it takes."""
    if set(arrays) != set(shapes):
        missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
        raise KVFileError(f"{path}: the cache's arrays do not match this model's: missing {missing[:4]}, "
                          f"unexpected {extra[:4]}")
    for name, (shape, dtype) in shapes.items():
        t = arrays[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise KVFileError(f"{path}: array {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                              f"this cache takes {str(dtype).removeprefix('torch.')} {list(shape)}")


def model_fingerprint(path: str | os.PathLike) -> dict:
    """The model file's size and a SHA-256 of its first 4 MiB (the header: metadata, tensor names, shapes and
    types) and of 16 slices of 64 KiB spread over the weights: another model or another quantization of it
    differs, and a multi-GB file is fingerprinted in milliseconds."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        for i in range(16):
            f.seek(size * i // 16)
            h.update(f.read(64 << 10))
    return {"bytes": size, "sha256": h.hexdigest()}


def check_meta(path, meta: dict, key: str, lo: int, hi: int) -> int:
    """``meta[key]``, an int in [lo, hi], else KVFileError."""
    v = meta.get(key) if isinstance(meta, dict) else None
    if type(v) is not int or not lo <= v <= hi:
        raise KVFileError(f"{path}: the cache's {key}={v!r} is not allowed here (must be {lo}..{hi})")
    return v
