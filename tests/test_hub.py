"""ktquest.hub and ktquest.catalog against a stand-in of the Hugging Face hub on 127.0.0.1
(tools/hub_standin.py: the model-info endpoint and ``resolve/main/<file>`` with the headers huggingface_hub
reads; it counts the requests and can cut a download, lie about a checksum or a size)."""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from huggingface_hub import constants

from ktquest import catalog, hub
from ktquest.config import load_config
from ktquest.formats.gguf import open_gguf
from ktquest.hub import HubError, ModelNotCached, ModelRef, parse_ref
from ktquest.models.loader import read_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from hub_standin import COMMIT, HubStandin  # noqa: E402


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A running HubStandin that ktquest.hub talks to, with an empty hub cache and ktquest cache
    (``XDG_CACHE_HOME``) under tmp_path."""
    server = HubStandin()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def tiny_bytes(tiny_models) -> bytes:
    return tiny_models("llama").path.read_bytes()


def split_gguf(src: Path, out: Path, tensors_per_part: int) -> list[Path]:
    """``src`` written as gguf-split parts (``out``'s stem + -0000N-of-0000M.gguf), as llama.cpp splits."""
    r = gguf.GGUFReader(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch=arch, split_max_tensors=tensors_per_part)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(name, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-0*-of-*.gguf"))


# ---- references ----


@pytest.mark.parametrize("text, ref", [
    ("owner/name", ModelRef("owner/name")),
    ("owner/name:q4_k_m", ModelRef("owner/name", quant="Q4_K_M")),
    ("owner/Name-GGUF:Model-Q8_0.gguf", ModelRef("owner/Name-GGUF", file="Model-Q8_0.gguf")),
    ("smollm2-135m", None),  # a bundled model
    ("model.gguf", None),  # a local file, there or not
    ("dir/model.gguf", None),
    ("/abs/path", None),
])
def test_parse_ref(text, ref):
    assert parse_ref(text) == ref


def test_parse_ref_existing_path_and_bad_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert parse_ref("owner/name") is None
    with pytest.raises(ValueError, match="REPO:QUANT"):
        parse_ref("a/b:Q4 K")


def test_quant_of():
    assert hub.quant_of("Qwen3-8B-Q4_K_M.gguf") == "Q4_K_M"
    assert hub.quant_of("sub/model.q8_0-00001-of-00002.gguf") == "Q8_0"
    assert hub.quant_of("gemma-3-UD-IQ2_XXS.gguf") == "IQ2_XXS"
    assert hub.quant_of("model-bf16.gguf") == "BF16"
    assert hub.quant_of("model.gguf") is None


# ---- pull ----


def test_pull_downloads_and_lists(fake_hub: HubStandin, tiny_bytes: bytes):
    fake_hub.repos["o/m"] = {"README.md": b"hi", "m-Q4_K_M.gguf": tiny_bytes, "m-Q8_0.gguf": tiny_bytes,
                             "mmproj-F16.gguf": b"proj"}
    path = hub.pull(parse_ref("o/m:q4_k_m"), progress=False)
    assert path.read_bytes() == tiny_bytes and path.name == "m-Q4_K_M.gguf"
    assert str(path).startswith(constants.HF_HUB_CACHE)
    assert not any("Q8_0" in p or "mmproj" in p for _, p, _ in fake_hub.requests)
    assert hub.resolve_cached(ModelRef("o/m", quant="Q4_K_M")) == path
    assert hub.pull(ModelRef("o/m", file="m-Q4_K_M.gguf"), progress=False) == path
    with pytest.raises(HubError, match=r"no Q5_K_M GGUF file; the GGUF models there: "
                                       r"Q4_K_M \(m-Q4_K_M.gguf\), Q8_0 \(m-Q8_0.gguf\)"):
        hub.pull(ModelRef("o/m", quant="Q5_K_M"), progress=False)
    with pytest.raises(HubError, match="2 GGUF models match.*o/m:Q4_K_M, o/m:Q8_0"):
        hub.pull(ModelRef("o/m"), progress=False)
    with pytest.raises(HubError, match="no such model repository"):
        hub.pull(ModelRef("o/missing"), progress=False)


def test_pull_the_only_gguf(fake_hub: HubStandin, tiny_bytes: bytes):
    fake_hub.repos["o/one"] = {"config.json": b"{}", "one.gguf": tiny_bytes}
    assert hub.pull(ModelRef("o/one"), progress=False).read_bytes() == tiny_bytes


def test_pull_resumes_a_cut_download(fake_hub: HubStandin):
    # huggingface_hub writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB): a cut resumes after
    # the last whole chunk, so the file (not parsed by pull) is 3 chunks and cut after 1.5
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = np.random.default_rng(0).integers(0, 256, 3 * chunk, dtype=np.uint8).tobytes()
    fake_hub.repos["o/m"] = {"m-Q8_0.gguf": data}
    fake_hub.cut_once.add("m-Q8_0.gguf")
    path = hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    assert path.read_bytes() == data
    gets = [rng for method, p, rng in fake_hub.requests if method == "GET" and "/resolve/" in p]
    assert gets == [None, f"bytes={chunk}-"]  # the second asks for the rest only


@pytest.mark.parametrize("lie, error", [("bad_sha", "sha256 .* the file was deleted"),
                                         ("bad_size", "downloading m-Q8_0.gguf failed: Consistency check failed")])
def test_pull_refuses_a_wrong_checksum_or_size(fake_hub: HubStandin, tiny_bytes: bytes, lie, error):
    fake_hub.repos["o/m"] = {"m-Q8_0.gguf": tiny_bytes}
    getattr(fake_hub, lie).add("m-Q8_0.gguf")
    with pytest.raises(HubError, match=error):
        hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    assert hub.resolve_cached(ModelRef("o/m", quant="Q8_0")) is None
    if lie == "bad_sha":
        assert not list(Path(constants.HF_HUB_CACHE).rglob("blobs/*"))


def test_pull_joins_a_split_model(fake_hub: HubStandin, tiny_models, tmp_path: Path):
    src = tiny_models("llama").path
    parts = split_gguf(src, tmp_path / "split" / "m-Q8_0.gguf", tensors_per_part=8)
    assert len(parts) >= 3
    fake_hub.repos["o/s"] = {f"Q8_0/{p.name}": p.read_bytes() for p in parts}
    path = hub.pull(ModelRef("o/s", quant="Q8_0"), progress=False)
    assert path.name == "m-Q8_0.gguf" and path.is_file()
    downloaded = {p for m, p, _ in fake_hub.requests if m == "GET" and "/resolve/" in p}
    assert len(downloaded) == len(parts)
    joined, original = read_gguf(path), read_gguf(src)
    assert joined.args == original.args
    assert {k: v for k, v in joined.metadata.items() if not k.startswith("split.")} == original.metadata
    assert not any(k.startswith("split.") for k in joined.metadata)
    assert list(joined.tensors) == list(original.tensors)
    for name in original.tensors:
        np.testing.assert_array_equal(joined.tensors[name], original.tensors[name])
    assert hub.resolve_cached(ModelRef("o/s", quant="Q8_0")) == path
    path.unlink()  # the parts are cached: joined again without the network
    n = len(fake_hub.requests)
    assert hub.resolve_cached(ModelRef("o/s", quant="Q8_0")) == path and path.is_file()
    assert len(fake_hub.requests) == n


def test_pull_downloads_every_part_at_the_listed_commit(fake_hub: HubStandin, tiny_models, tmp_path: Path):
    parts = split_gguf(tiny_models("llama").path, tmp_path / "split" / "m-Q8_0.gguf", tensors_per_part=8)
    fake_hub.repos["o/s"] = {p.name: p.read_bytes() for p in parts}
    hub.pull(ModelRef("o/s", quant="Q8_0"), progress=False)
    files = [p for _, p, _ in fake_hub.requests if "/resolve/" in p]
    assert files and all(f"/resolve/{COMMIT}/" in p for p in files)  # not main: it may move meanwhile
    main = Path(constants.HF_HUB_CACHE) / "models--o--s" / "refs" / "main"
    assert main.read_text() == COMMIT


def test_a_check_cut_short_is_done_before_the_file_is_used(fake_hub: HubStandin, tiny_bytes: bytes,
                                                           monkeypatch: pytest.MonkeyPatch):
    """A Ctrl-C while ``pull`` hashed a download whose sha256 is wrong: the next pull, and ``--model``, check
    it before they use it."""
    fake_hub.repos["o/m"] = {"m-Q8_0.gguf": tiny_bytes}
    fake_hub.bad_sha.add("m-Q8_0.gguf")

    class Interrupted:
        def update(self, _):
            raise KeyboardInterrupt

    interrupted = SimpleNamespace(sha256=Interrupted)
    monkeypatch.setattr(hub, "hashlib", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    monkeypatch.setattr(hub, "hashlib", hashlib)
    with pytest.raises(HubError, match="sha256 .* the file was deleted, run ktquest pull o/m:Q8_0 again"):
        hub.resolve_cached(ModelRef("o/m", quant="Q8_0"))
    assert hub.resolve_cached(ModelRef("o/m", quant="Q8_0")) is None
    monkeypatch.setattr(hub, "hashlib", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    monkeypatch.setattr(hub, "hashlib", hashlib)
    with pytest.raises(HubError, match="sha256 .* the file was deleted"):
        hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    fake_hub.bad_sha.clear()
    path = hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    sha = hashlib.sha256(tiny_bytes).hexdigest()
    assert path.resolve().name == sha and (hub.ktquest_cache() / "verified" / sha).is_file()


# ---- offline and the cache ----


def test_an_earlier_pull_resolves_after_an_upstream_commit(fake_hub: HubStandin, tiny_bytes: bytes,
                                                          monkeypatch: pytest.MonkeyPatch):
    fake_hub.repos["o/m"] = {"m-Q4_K_M.gguf": tiny_bytes}
    q4 = hub.pull(ModelRef("o/m", quant="Q4_K_M"), progress=False)
    fake_hub.commit = "fedcba9876543210fedcba9876543210fedcba98"  # upstream: the Q4_K_M file replaced
    fake_hub.repos["o/m"] = {"m-Q8_0.gguf": tiny_bytes + b"\0"}
    q8 = hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    assert q8.parent.name == fake_hub.commit != q4.parent.name
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(fake_hub.requests)
    assert hub.require_cached(ModelRef("o/m", quant="Q4_K_M")) == q4
    assert hub.resolve_model("o/m:Q8_0") == q8
    monkeypatch.setattr(catalog, "BUNDLED_MODELS", {})
    assert {m.name for m in catalog.cached_models()} == {"o/m:Q4_K_M", "o/m:Q8_0"}
    assert len(fake_hub.requests) == n


def test_joined_files_are_in_ktquest_cache_keyed_by_the_parts(fake_hub: HubStandin, tiny_models,
                                                              tmp_path: Path):
    parts = split_gguf(tiny_models("llama").path, tmp_path / "split" / "m-Q8_0.gguf", tensors_per_part=8)
    fake_hub.repos["o/s"] = {p.name: p.read_bytes() for p in parts}
    joined = hub.pull(ModelRef("o/s", quant="Q8_0"), progress=False)
    assert joined.is_relative_to(tmp_path / "xdg" / "ktquest" / "joined")
    assert hub.ktquest_cache() == tmp_path / "xdg" / "ktquest"
    mtime = joined.stat().st_mtime_ns
    fake_hub.commit = "fedcba9876543210fedcba9876543210fedcba98"  # an unrelated upstream commit
    fake_hub.repos["o/s"]["README.md"] = b"new"
    assert hub.pull(ModelRef("o/s", quant="Q8_0"), progress=False) == joined
    assert joined.stat().st_mtime_ns == mtime  # not joined again
    whole = joined.read_bytes()
    joined.write_bytes(whole[:1000])  # torn (a crash while an older version wrote it, a full disk)
    assert hub.resolve_cached(ModelRef("o/s", quant="Q8_0")) == joined and joined.read_bytes() == whole


def test_a_mistyped_path_says_there_is_no_such_file(fake_hub: HubStandin):
    with pytest.raises(ModelNotCached, match=r"^no such file models/qwen, and OWNER/NAME models/qwen is not "
                                             r"downloaded; download it with: ktquest pull models/qwen$"):
        hub.resolve_model("models/qwen")
    with pytest.raises(ModelNotCached, match=r"^the model models/qwen:Q4_K_M is not downloaded"):
        hub.resolve_model("models/qwen:Q4_K_M")
    assert fake_hub.requests == []




def test_offline_resolves_from_the_cache(fake_hub: HubStandin, tiny_bytes: bytes,
                                         monkeypatch: pytest.MonkeyPatch):
    fake_hub.repos["o/m"] = {"m-Q4_K_M.gguf": tiny_bytes, "m-Q8_0.gguf": tiny_bytes}
    path = hub.pull(ModelRef("o/m", quant="Q4_K_M"), progress=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(fake_hub.requests)
    assert hub.pull(ModelRef("o/m", quant="q4_k_m".upper()), progress=False) == path
    assert hub.require_cached(ModelRef("o/m", quant="Q4_K_M")) == path
    with pytest.raises(ModelNotCached, match=r"ktquest pull o/m:Q8_0 \(HF_HUB_OFFLINE is set"):
        hub.pull(ModelRef("o/m", quant="Q8_0"), progress=False)
    assert len(fake_hub.requests) == n  # no request made offline


def test_resolve_cached_none_and_the_pull_hint(fake_hub: HubStandin):
    ref = parse_ref("o/m:Q4_K_M")
    assert hub.resolve_cached(ref) is None
    assert hub.pull_hint(ref) == ("the model o/m:Q4_K_M is not downloaded; download it with: "
                                  "ktquest pull o/m:Q4_K_M")
    with pytest.raises(ModelNotCached) as e:
        hub.require_cached(ref)
    assert str(e.value) == hub.pull_hint(ref)
    assert fake_hub.requests == []


# ---- ktquest list ----


def test_cached_models(fake_hub: HubStandin, tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = tiny_models("llama").path
    fake_hub.repos["o/m"] = {"m-F32.gguf": src.read_bytes()}
    parts = split_gguf(src, tmp_path / "split" / "s-Q8_0.gguf", tensors_per_part=8)
    fake_hub.repos["o/s"] = {p.name: p.read_bytes() for p in parts}
    hub.pull(ModelRef("o/m"), progress=False)
    joined = hub.pull(ModelRef("o/s"), progress=False)
    monkeypatch.setattr(catalog, "BUNDLED_MODELS", {})
    models = {m.name: m for m in catalog.cached_models()}
    assert set(models) == {"o/m:F32", "o/s:Q8_0"}  # as --model takes them: the quantization names the file
    m = models["o/m:F32"]
    args = read_gguf(src).args
    assert (m.source, m.info.arch, m.info.file_type) == ("hub", "llama", "ALL_F32")
    assert (m.info.n_params, m.info.context_length) == (args.n_params, 256)
    assert m.info.file_size == src.stat().st_size
    assert m.fits_dense is True
    assert m.fits_long_context is False  # the snapkv preset's Q8_0 store needs head_dim in groups of 32
    assert models["o/s:Q8_0"].info.path == joined
    assert parse_ref(m.name) == ModelRef("o/m", quant="F32") and hub.resolve_model(m.name) == hub.resolve_model(
        "o/m:m-F32.gguf")


def test_cached_models_a_split_model_not_joined(fake_hub: HubStandin, tiny_models, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch):
    parts = split_gguf(tiny_models("llama").path, tmp_path / "split" / "s-Q8_0.gguf", tensors_per_part=8)
    fake_hub.repos["o/s"] = {p.name: p.read_bytes() for p in parts}
    joined = hub.pull(ModelRef("o/s"), progress=False)
    for p in joined.parent.iterdir():
        p.unlink()
    monkeypatch.setattr(catalog, "BUNDLED_MODELS", {})
    (m,) = catalog.cached_models()
    assert m.info.file_size == sum(p.stat().st_size for p in parts) and m.info.path.name == parts[0].name
    assert "split in" in m.notes[0] and "not joined yet" in m.notes[0]
    whole = tiny_models("llama").path  # the fit check counts the size given (the parts' sum), not the file's
    assert catalog._entry("m", "hub", whole, None).fits_dense is True
    assert catalog._entry("m", "hub", whole, None, size=10**18).fits_dense is False


def test_fits(tiny_models, monkeypatch: pytest.MonkeyPatch):
    info = catalog.read_info(tiny_models("llama").path)
    fp16 = load_config(overrides=[("mode", "long_context"), ("long_context.kv_type", "FP16")])
    assert catalog.fits(info, "long_context", fp16) is True
    monkeypatch.setattr(catalog.memory, "available_ram", lambda: info.file_size)  # the weights and no more
    assert catalog.fits(info, "dense") is False
    assert catalog.fits(info, "long_context", fp16) is False
    broken = catalog.ModelInfo(info.path, 1, None, None, None, "unknown architecture")
    assert catalog.fits(broken, "dense") is None
    assert open_gguf(info.path).metadata["general.architecture"] == "llama"


def test_the_command_line_pulls_lists_and_chats_offline(fake_hub: HubStandin, tiny_bytes: bytes, capsys,
                                                        monkeypatch: pytest.MonkeyPatch):
    """``ktquest pull o/m:Q4_K_M``, ``ktquest list`` shows it, ``ktquest chat -m o/m:Q4_K_M`` answers with the
    hub offline (no request); a model not pulled is refused with the command to run."""
    from ktquest.cli import main

    fake_hub.repos["o/m"] = {"m-Q4_K_M.gguf": tiny_bytes}
    assert main(["pull", "o/m:Q4_K_M"]) == 0
    out = capsys.readouterr().out
    assert "m-Q4_K_M.gguf" in out and "ktquest chat -m o/m:Q4_K_M" in out
    assert main(["list"]) == 0
    assert "o/m:Q4_K_M " in capsys.readouterr().out
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(fake_hub.requests)
    assert main(["chat", "-m", "o/m:Q4_K_M", "-p", "hi", "-n", "2", "-t", "1"]) == 0
    assert len(fake_hub.requests) == n
    capsys.readouterr()
    assert main(["chat", "-m", "o/other:Q4_K_M", "-p", "hi"]) == 2
    assert "download it with: ktquest pull o/other:Q4_K_M" in capsys.readouterr().err


def test_list_names_a_model_by_its_quantization_where_that_is_unique():
    models = {"a-Q4_K_M.gguf": [], "b-Q4_K_M.gguf": [], "a-Q8_0.gguf": [], "notes.gguf": []}
    assert [catalog._pick(m, models) for m in models] == ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf", "Q8_0", "notes.gguf"]
