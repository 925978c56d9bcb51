"""ktquest.formats.gguf_split: a split model joined once, atomically, under a lock, and re-joined when the
joined file is not the whole join of its parts; a malformed part is one GGUFError naming it."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from ktquest.formats import gguf_split
from ktquest.formats.errors import GGUFError
from ktquest.formats.gguf import open_gguf
from ktquest.formats.gguf_split import is_joined, join_split

TENSORS = {f"t{i}": np.arange(64, dtype=np.float32) * (i + 1) for i in range(4)}


def write_split(folder: Path, stem: str = "m") -> list[Path]:
    """A model of 4 tensors written as gguf-split parts of 2 tensors each: ``stem-0000N-of-00002.gguf``."""
    folder.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(folder / f"{stem}.gguf", arch="llama", split_max_tensors=2)
    w.add_uint32("llama.context_length", 256)
    for name, data in TENSORS.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(folder.glob(f"{stem}-0*-of-*.gguf"))


@pytest.fixture
def parts(tmp_path: Path) -> list[Path]:
    found = write_split(tmp_path / "parts")
    assert len(found) == 2
    return found


def check_joined(path: Path) -> None:
    f = open_gguf(path)
    assert f.metadata["llama.context_length"] == 256
    assert not any(k.startswith("split.") for k in f.metadata)
    assert list(f.tensors) == list(TENSORS)
    for name, data in TENSORS.items():
        np.testing.assert_array_equal(f.tensors[name].reshape(-1), data)


def test_join_writes_the_file_and_its_record(parts: list[Path], tmp_path: Path):
    out = join_split(parts, tmp_path / "j" / "m.gguf")
    check_joined(out)
    assert is_joined(parts, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.gguf.lock", "m.gguf.parts.json"]


def test_a_torn_joined_file_is_joined_again(parts: list[Path], tmp_path: Path):
    out = join_split(parts, tmp_path / "m.gguf")
    whole = out.read_bytes()
    out.write_bytes(whole[: len(whole) // 2])  # torn (a crash, a full disk)
    assert not is_joined(parts, out)
    assert join_split(parts, out) == out and out.read_bytes() == whole


def test_a_joined_file_without_a_record_or_of_other_parts_is_joined_again(parts: list[Path], tmp_path: Path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"GGUF not a join")  # an earlier version's file, or anything
    assert not is_joined(parts, out)
    check_joined(join_split(parts, out))
    other = write_split(tmp_path / "other", stem="m2")
    other[1].write_bytes(other[1].read_bytes() + b"\0" * 32)  # another part 2 (another size)
    assert not is_joined(other, out)


def test_leftover_partial_files_are_not_used(parts: list[Path], tmp_path: Path):
    out = tmp_path / "m.gguf"
    (tmp_path / "m.gguf.partial").write_bytes(b"an old version's partial file")
    (tmp_path / "m.gguf.abc123.partial").write_bytes(b"a crashed join")
    check_joined(join_split(parts, out))
    assert not (tmp_path / "m.gguf.abc123.partial").exists()  # removed under the lock
    assert not list(tmp_path.glob("*.tmp"))


def test_two_joins_at_once_join_once(parts: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    writes, write = [], gguf_split._write_gguf

    def slow_write(*args):
        writes.append(1)
        time.sleep(0.3)  # the second join waits on the lock meanwhile
        write(*args)

    monkeypatch.setattr(gguf_split, "_write_gguf", slow_write)
    out, results = tmp_path / "m.gguf", []
    threads = [threading.Thread(target=lambda: results.append(join_split(parts, out))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out, out] and len(writes) == 1
    check_joined(out)


def test_a_part_whose_header_claims_2_40_keys(parts: list[Path], tmp_path: Path):
    bad = tmp_path / "bad-00002-of-00002.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40) + b"\0" * 64)
    with pytest.raises(GGUFError) as e:
        join_split([parts[0], bad], tmp_path / "m.gguf")
    assert str(e.value).startswith(f"{bad}: ") and "\n" not in str(e.value)
    assert not (tmp_path / "m.gguf").exists()


def test_a_truncated_part(parts: list[Path], tmp_path: Path):
    data = parts[1].read_bytes()
    for cut in (10, 40, len(data) - 8):
        parts[1].write_bytes(data[:cut])
        with pytest.raises(GGUFError) as e:
            join_split(parts, tmp_path / "m.gguf")
        assert str(e.value).startswith(f"{parts[1]}: ") and "\n" not in str(e.value)
    assert not list(tmp_path.glob("m.gguf*partial"))


def test_a_part_in_the_wrong_place(parts: list[Path], tmp_path: Path):
    with pytest.raises(GGUFError, match=r"its split keys say part 1 of 2, expected part 0 of 2"):
        join_split(parts[::-1], tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="no such file"):
        join_split([parts[0], tmp_path / "missing.gguf"], tmp_path / "m.gguf")
