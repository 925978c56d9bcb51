"""Split GGUF files (llama.cpp's ``gguf-split``: ``name-00001-of-00003.gguf``) joined into one file.

Each part is a whole GGUF file: the first holds the model's metadata, every part some of the tensors, and the
``split.*`` keys say which part it is. ktquest maps one file (``formats/gguf.py``), so a split model is read
once after it is joined: the first part's metadata without ``split.*``, then every part's tensors in order.

A joined file is trusted only with its record (``<file>.parts.json``, written once the file is on disk): the
parts it was joined from (their real files' names and sizes) and its own size. Anything else (no record, a
record of other parts, another size: a file torn by a crash or cut short) is joined again. The join holds an
exclusive lock (``<file>.lock``), so a second process joining the same model waits and then finds it done,
and writes a uniquely named ``*.partial`` file in the same folder, renamed onto the final name when whole.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import tempfile
from pathlib import Path

import gguf

from ktquest.formats.errors import GGUFError
from ktquest.formats.gguf import open_gguf

try:
    import fcntl
except ImportError:  # (not on Windows: no lock there)
    fcntl = None

# "model-Q4_K_M-00001-of-00003.gguf": its stem, the part and the count
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# What a gguf.GGUFReader raises on a file it cannot parse (besides the GGUFError open_gguf raises first).
_READ_ERRORS = (OSError, ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError)


def split_part(name: str) -> tuple[str, int, int] | None:
    """``(stem, part, count)`` of a split GGUF's file name (parts count from 1), None for a whole file."""
    m = SPLIT_NAME.match(name)
    return (m["stem"], int(m["no"]), int(m["count"])) if m else None


def join_split(parts: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """The split model ``parts`` (in order, the first holding the metadata) as one GGUF file ``out``: the file
    there when its record says it was joined from these parts and its size is the recorded one, else joined
    now (under ``out``'s lock; see the module's doc). ``GGUFError`` naming the part when a part is missing,
    not GGUF, truncated or corrupt, or says it is another part than its place in ``parts``; naming ``out``
    when it cannot be written."""
    out = Path(out)
    if is_joined(parts, out):  # (no lock needed: the record is written after the file, removed before it)
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _locked(out.with_name(out.name + ".lock")):
            if not is_joined(parts, out):
                _remove_partials(out)  # a crashed join's (nobody else writes one while the lock is held)
                _write_joined(parts, out)
    except OSError as e:
        raise GGUFError(f"{out}: the joined model cannot be written: {e.strerror or e}") from None
    return out


def is_joined(parts: list[str | os.PathLike], out: str | os.PathLike) -> bool:
    """Whether ``out`` is a whole join of ``parts``: its record names these parts and its size."""
    out = Path(out)
    try:
        record = json.loads(_record_path(out).read_text())
        return record == _record(parts, out.stat().st_size)
    except (OSError, ValueError):
        return False


def _record_path(out: Path) -> Path:
    return out.with_name(out.name + ".parts.json")


def _record(parts: list[str | os.PathLike], size: int) -> dict:
    """What a joined file's record holds: its size and its parts' real names (a hub cache's blob, named by
    its hash) and sizes."""
    real = [Path(os.path.realpath(p)) for p in parts]
    return {"size": size, "parts": [[p.name, p.stat().st_size] for p in real]}


@contextlib.contextmanager
def _locked(lock: Path):
    """An exclusive ``flock`` on the file ``lock`` (made if needed, never deleted) while the block runs."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _remove_partials(out: Path) -> None:
    """Delete what a crashed join of ``out`` left: its ``*.partial`` files and a half-written record."""
    for pattern in ("*.partial", "*.json.tmp"):
        for p in out.parent.glob(f"{glob.escape(out.name)}.{pattern}"):
            p.unlink(missing_ok=True)


def _write_joined(parts: list[str | os.PathLike], out: Path) -> None:
    """Join ``parts`` into a new ``*.partial`` file, fsync it, rename it onto ``out``, fsync the folder and
    write the record (the old record is removed first: ``out`` is never trusted half-replaced)."""
    readers = [_read_part(part, i, len(parts)) for i, part in enumerate(parts)]
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    try:
        _write_gguf(readers, parts, partial)
        _fsync(partial)
        _record_path(out).unlink(missing_ok=True)
        os.replace(partial, out)
        _fsync(out.parent)
        _write_record(out, _record(parts, out.stat().st_size))
    finally:
        partial.unlink(missing_ok=True)


def _read_part(part: str | os.PathLike, i: int, count: int) -> gguf.GGUFReader:
    """Part ``i`` (from 0) of ``count``, checked by ktquest's bounded reader first (``GGUFError`` naming the
    file), then read by gguf's; its ``split.*`` keys must say it is that part."""
    open_gguf(part)
    try:
        r = gguf.GGUFReader(part)
        no = _field(r, gguf.Keys.Split.LLM_KV_SPLIT_NO)
        count_key = _field(r, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    except _READ_ERRORS as e:
        raise GGUFError(f"{part}: cannot be read as a GGUF part ({type(e).__name__}: {e})") from None
    if count_key is not None and (count_key != count or no != i):  # split.no counts from 0
        raise GGUFError(f"{part}: its split keys say part {no} of {count_key}, expected part {i} of {count}")
    return r


def _write_gguf(readers: list[gguf.GGUFReader], parts: list, path: Path) -> None:
    """The first reader's metadata (less ``split.*``), then every reader's tensors in order, as GGUF
    ``path``."""
    first = readers[0]
    arch = _field(first, gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise GGUFError(f"{parts[0]}: no {gguf.Keys.General.ARCHITECTURE} key (the first part holds it)")
    w = gguf.GGUFWriter(path, arch=arch, endianess=first.endianess)
    try:
        alignment = _field(first, gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            w.data_alignment = alignment
        for name, field in first.fields.items():
            if name.startswith(("GGUF.", "split.")) or name == gguf.Keys.General.ARCHITECTURE:
                continue  # the reader's bookkeeping, the parts' numbering; the writer adds the architecture
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
        tensors = [(part, t) for part, r in zip(parts, readers) for t in r.tensors]
        for part, t in tensors:
            try:
                w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            except ValueError as e:  # a tensor name twice
                raise GGUFError(f"{part}: tensor {t.name!r}: {e}") from None
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, t in tensors:
            w.write_tensor_data(t.data, tensor_endianess=first.endianess)
    finally:
        w.close()


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_record(out: Path, record: dict) -> None:
    """``out``'s record, written whole (a temporary file renamed) and flushed."""
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, _record_path(out))
        _fsync(out.parent)
    finally:
        Path(name).unlink(missing_ok=True)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()
