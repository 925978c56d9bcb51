"""Split GGUF files (llama.cpp's ``gguf-split``: ``name-00001-of-00003.gguf``) joined into one file.

Each part is a whole GGUF file: the first holds the model's metadata, every part some of the tensors, and the
``split.*`` keys say which part it is. ktquest maps one file (``formats/gguf.py``), so a split model is read
once after it is joined: the first part's metadata without ``split.*``, then every part's tensors in order.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import gguf

from ktquest.formats.errors import GGUFError

# "model-Q4_K_M-00001-of-00003.gguf": its stem, the part and the count
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_part(name: str) -> tuple[str, int, int] | None:
    """``(stem, part, count)`` of a split GGUF's file name (parts count from 1), None for a whole file."""
    m = SPLIT_NAME.match(name)
    return (m["stem"], int(m["no"]), int(m["count"])) if m else None


def join_split(parts: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write the split model ``parts`` (in order, the first holding the metadata) as one GGUF file ``out``.

    Written to ``out.partial`` and renamed when whole, so ``out`` is never a torn file. ``GGUFError`` naming
    the part when a part is not GGUF, is missing, or says it is another part than its place in ``parts``."""
    out = Path(out)
    readers = []
    for i, part in enumerate(parts, 1):
        try:
            r = gguf.GGUFReader(part)
        except (OSError, ValueError) as e:
            raise GGUFError(f"{part}: cannot be read as a GGUF part ({e})") from None
        no, count = _field(r, gguf.Keys.Split.LLM_KV_SPLIT_NO), _field(r, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        if count is not None and (count != len(parts) or no != i - 1):  # split.no counts from 0
            raise GGUFError(f"{part}: its split keys say part {no} of {count}, expected part {i - 1} of "
                            f"{len(parts)}")
        readers.append(r)
    first = readers[0]
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        arch = _field(first, gguf.Keys.General.ARCHITECTURE)
        w = gguf.GGUFWriter(partial, arch=arch, endianess=first.endianess)
        alignment = _field(first, gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            w.data_alignment = alignment
        for name, field in first.fields.items():
            if name.startswith(("GGUF.", "split.")) or name == gguf.Keys.General.ARCHITECTURE:
                continue  # the reader's bookkeeping, the parts' numbering; the writer adds the architecture
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
        tensors = [t for r in readers for t in r.tensors]
        for t in tensors:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(t.data, tensor_endianess=first.endianess)
        w.close()
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()
