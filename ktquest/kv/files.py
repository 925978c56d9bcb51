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
Written only where ``check_target`` allows: a new path, an empty file or a KV file, never the engine's model
or config file (by its name or through a link) nor anything that is not a regular file.

Read with positioned reads into memory of the reader's own, never mapped: a file truncated or rewritten in
place while it is read gives a short read or a checksum that does not match (a mapping would fault with
SIGBUS). Nothing that is not a regular file is opened blocking (a FIFO would wait for a writer forever). The
header is checked as a schema before any array is read (``_check_table``: types, nesting, every size against
the file's, the arrays in order without overlap), the header's checksum first and each array's after it is
read, the floating-point arrays finite: every failure is a ``KVFileError`` naming the file and what is wrong.

What each cache keeps is its own: ``state()`` -> (scalars, arrays), ``state_shapes(scalars)`` (what a file's
arrays must be, or ``KVFileError``), ``check_state(scalars, arrays)`` (those and the values it would index
with, before anything is filled), ``load_state(scalars, arrays)``. Whether a file fits an engine (its model,
its settings, its tokens) is ``kv/compat.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tempfile
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from ktquest.config_file import show

MAGIC = b"KTQKV\0"
FORMAT = 1
ALIGN = 64
MAX_HEADER = 256 << 20  # a header past this is corruption, not a conversation
MAX_DEPTH = 16  # the header nests ~6 levels (a hybrid cache's planner state); deeper is not one ktquest wrote
MAX_DIMS = 8
MAX_ARRAYS = 1 << 16  # a cache keeps a few arrays a layer
_MAX_ELEMENTS = 1 << 48  # an array's dims multiplied (a 0 counted as 1): past this, torch's strides overflow
_PREFIX = struct.Struct("<6sHQ")  # magic, format, header bytes
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
           "int32": torch.int32, "int64": torch.int64}


class KVFileError(ValueError):
    """A KV file that cannot be used here: unreadable, truncated, corrupted, or from another model or config;
    or a path a KV file may not be written to."""


# ---- writing ----


def save(path: str | os.PathLike, header: dict, arrays: dict[str, torch.Tensor],
         protect: dict[str, str | os.PathLike | None] | None = None) -> int:
    """Write ``header`` (JSON-able) and ``arrays`` to ``path`` atomically; returns the file's bytes. KVFileError
    where ``check_target(path, protect)`` refuses it (checked before writing and again before the rename)."""
    path = Path(path)
    check_target(path, protect)
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
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise KVFileError(f"{path}: cannot write a KV file in {path.parent}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT, len(head)) + head + struct.pack("<I", zlib.crc32(head)))
            for name, (off, raw) in tensors.items():
                f.seek(start + off)
                f.write(raw)
            f.truncate(start + offset)
            f.flush()
            os.fsync(f.fileno())
        check_target(path, protect)  # (what the path is may have changed while the file was written)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return start + offset


def check_target(path: str | os.PathLike, protect: dict[str, str | os.PathLike | None] | None = None) -> None:
    """KVFileError unless a KV file may be written at ``path``: a path that does not exist, or a regular file
    (not a symlink) that is empty or a KV file and is none of ``protect`` (what -> path, e.g. ``{"the model
    file": ...}``), neither by name nor through a link (the same device and inode, symlinks resolved)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # a new file (a missing directory is said by save)
    except (OSError, ValueError) as e:
        raise KVFileError(f"{path}: cannot write a KV file there: {_reason(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KVFileError(f"{path} is {_kind(st.st_mode)}: a KV file is written to a new path or over a KV file, "
                          "nothing else")
    for what, other in (protect or {}).items():
        try:
            o = os.stat(other) if other is not None else None
        except OSError:
            continue
        if o is not None and (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino):
            same = "" if os.path.abspath(path) == os.path.abspath(other) else f" ({other}, through a link)"
            raise KVFileError(f"{path} is {what}{same}: a KV file is never written over it")
    if st.st_size:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                magic = os.pread(fd, len(MAGIC), 0)
            finally:
                os.close(fd)
        except OSError as e:
            raise KVFileError(f"{path}: cannot write a KV file there: {e.strerror}") from None
        if magic != MAGIC:
            raise KVFileError(f"{path} exists and is not a KV file: it is not written over (a KV file is written "
                              "to a new path or over a KV file)")


# ---- reading ----


class _Entry(NamedTuple):
    """One array of the header's table, checked."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    offset: int
    nbytes: int
    crc: int


def load(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header (a dict) and the arrays of a KV file, each array read into a tensor of its own and its
    checksum checked; ``KVFileError`` naming the file and what is wrong, whatever is wrong with it."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < _PREFIX.size + 4:
            raise KVFileError(f"{path}: not a KV file ({size} bytes, too short for the header)")
        magic, fmt, n = _PREFIX.unpack(_read(fd, path, _PREFIX.size, 0))
        if magic != MAGIC:
            raise KVFileError(f"{path}: not a KV file (it does not start with {MAGIC!r})")
        if fmt != FORMAT:
            raise KVFileError(f"{path}: KV file format {fmt}; this ktquest reads format {FORMAT}")
        if n > min(MAX_HEADER, size - _PREFIX.size - 4):
            raise KVFileError(f"{path}: truncated or corrupted: its header says {n:,} bytes, the file has {size:,}")
        head = _read(fd, path, n + 4, _PREFIX.size)
        if zlib.crc32(head[:n]) != struct.unpack("<I", head[n:])[0]:
            raise KVFileError(f"{path}: corrupted: the header's checksum does not match")
        header = _parse(path, head[:n])
        start = -(-(_PREFIX.size + n + 4) // ALIGN) * ALIGN
        entries = _check_table(path, header, size - start)
        arrays = {e.name: _read_array(fd, path, start, e) for e in entries}
        now = os.fstat(fd)
        if (now.st_size, now.st_mtime_ns) != (size, st.st_mtime_ns):
            raise KVFileError(f"{path}: the file changed while it was read")
    finally:
        os.close(fd)
    return header, arrays


def _open_regular(path: Path) -> int:
    """A descriptor of ``path`` for reading, or KVFileError: a FIFO, a device, a directory is refused before it
    is opened, and after (opened without blocking: what it is may have changed in between)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
    except (OSError, ValueError) as e:
        raise KVFileError(f"{path}: cannot open the KV file: {_reason(e)}") from None
    raise KVFileError(f"{path} is {_kind(mode)}, not a KV file")


def _read(fd: int, path: Path, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    _read_into(fd, path, memoryview(buf), offset)
    return bytes(buf)


def _read_into(fd: int, path: Path, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from the file at ``offset``; KVFileError for a read error or a file that ends before."""
    done = 0
    while done < len(buf):
        try:
            got = os.preadv(fd, [buf[done:]], offset + done)  # (at most ~2 GiB a call)
        except OSError as e:
            raise KVFileError(f"{path}: cannot read the KV file: {e.strerror}") from None
        if got == 0:
            raise KVFileError(f"{path}: the file changed while it was read: it ends at byte {offset + done:,}, "
                              f"{offset + len(buf):,} were there when it was opened")
        done += got


def _parse(path: Path, head: bytes) -> dict:
    """The header's JSON as a dict nested at most MAX_DEPTH levels, or KVFileError."""
    try:
        header = json.loads(head)
    except RecursionError:
        raise KVFileError(f"{path}: corrupted header (JSON nested too deeply)") from None
    except MemoryError:
        raise KVFileError(f"{path}: corrupted header (its {len(head):,} bytes of JSON do not fit in memory)") from None
    except ValueError as e:  # not JSON, not UTF-8, an integer of too many digits
        raise KVFileError(f"{path}: corrupted header (not JSON: {str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise KVFileError(f"{path}: corrupted header (a JSON {type(header).__name__}, not an object)")
    level, nodes = 0, [header]
    while nodes:  # breadth first: a header nested deeper than MAX_DEPTH is refused without recursion
        level += 1
        if level > MAX_DEPTH:
            raise KVFileError(f"{path}: corrupted header (nested deeper than {MAX_DEPTH} levels)")
        nodes = [c for x in nodes for c in (x.values() if isinstance(x, dict) else x) if isinstance(c, (dict, list))]
    return header


def _check_table(path: Path, header: dict, payload: int) -> list[_Entry]:
    """The header's table of arrays, checked against ``payload`` (the file's bytes after the header): each entry
    a name, a dtype, a shape and its bytes, the arrays in order, aligned, without overlap, within the payload."""
    def bad(what: str) -> KVFileError:
        return KVFileError(f"{path}: corrupted header ({what})")

    table, said = header.get("arrays"), header.get("payload_bytes")
    if not isinstance(table, list) or len(table) > MAX_ARRAYS:
        raise bad(f"its table of arrays is {show(table)}")
    if type(said) is not int or said != payload:
        raise KVFileError(f"{path}: truncated or corrupted: {payload:,} bytes of arrays, the header says "
                          f"{show(said)}")
    entries, end, names = [], 0, set()
    for i, a in enumerate(table):
        fields = [a.get(k) for k in ("name", "dtype", "shape", "offset", "bytes", "crc32")] if isinstance(a, dict) \
            else None
        if fields is None or not isinstance(fields[0], str) or fields[0] in names:
            raise bad(f"entry {i} of its table of arrays is {show(a)}")
        name, dtype, shape, off, nbytes, crc = fields
        names.add(name)
        dt = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        dims = shape if isinstance(shape, list) and len(shape) <= MAX_DIMS and \
            all(type(d) is int and 0 <= d <= _MAX_ELEMENTS for d in shape) else None
        if dt is None or dims is None or not all(type(x) is int for x in (off, nbytes, crc)):
            raise bad(f"array {show(name)}: {show(dtype)} {show(shape)} at {show(off)}")
        count, extent = 1, 1
        for d in dims:
            count, extent = count * d, extent * max(d, 1)
        if extent > _MAX_ELEMENTS or count * dt.itemsize != nbytes or not 0 <= crc < 1 << 32:
            raise bad(f"array {name}: {dtype} {show(shape)} is not its {show(nbytes)} bytes")
        if off % ALIGN or not end <= off <= payload - nbytes:
            raise KVFileError(f"{path}: corrupted: array {name} at {off:,} (+{nbytes:,} bytes) overlaps another "
                              f"or lies outside the {payload:,} bytes of arrays")
        end = off + nbytes
        entries.append(_Entry(name, dt, tuple(dims), count, off, nbytes, crc))
    return entries


def _read_array(fd: int, path: Path, start: int, e: _Entry) -> torch.Tensor:
    try:
        t = torch.empty(e.count, dtype=e.dtype)
    except (MemoryError, RuntimeError):  # (torch's allocator says so with a RuntimeError)
        raise KVFileError(f"{path}: array {e.name} ({e.nbytes:,} bytes) does not fit in memory") from None
    raw = t.view(torch.uint8).numpy()
    _read_into(fd, path, memoryview(raw), start + e.offset)
    if zlib.crc32(raw) != e.crc:
        raise KVFileError(f"{path}: corrupted: the checksum of array {e.name} does not match")
    if t.is_floating_point() and e.count:
        lo, hi = torch.aminmax(t)  # a NaN or an infinity in them: NaN or +-inf here
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise KVFileError(f"{path}: corrupted: array {e.name} holds values that are not finite")
    return t.reshape(e.shape)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _reason(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


# ---- what a cache checks ----


def expect(path, arrays: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> None:
    """KVFileError unless ``arrays`` are exactly the names, shapes and dtypes of ``shapes`` (name -> (shape,
    dtype)): what a cache's ``state_shapes`` says it takes."""
    if set(arrays) != set(shapes):
        missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
        raise KVFileError(f"{path}: the cache's arrays do not match this model's: missing {show(missing[:4])}, "
                          f"unexpected {show(extra[:4])}")
    for name, (shape, dtype) in shapes.items():
        t = arrays[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise KVFileError(f"{path}: array {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                              f"this cache takes {str(dtype).removeprefix('torch.')} {show(list(shape))}")


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
        raise KVFileError(f"{path}: the cache's {key}={show(v)} is not allowed here (must be {lo}..{hi})")
    return v
