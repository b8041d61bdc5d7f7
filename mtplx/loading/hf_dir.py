"""Hugging Face model directories: config.json, generation_config.json, safetensors weights."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mtplx.errors import ModelLoadError

_INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_CHUNK = 1 << 20  # bytes per read when hashing


def read_hf_config(path: Path) -> dict:
    """The parsed ``config.json`` of a model directory (``text_config`` left as is)."""
    config = _read_json(Path(path) / "config.json", required=True)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{Path(path) / 'config.json'} must hold a JSON object, found {type(config).__name__}")
    return config


def read_generation_config(path: Path) -> dict:
    """The parsed ``generation_config.json`` of a model directory, or ``{}`` if there is none."""
    config = _read_json(Path(path) / "generation_config.json", required=False)
    return config if isinstance(config, dict) else {}


def load_safetensors_state_dict(
    path: Path,
    *,
    dtype: torch.dtype | None = None,
    key_filter: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every safetensors tensor of a model directory (CPU tensors, stored shapes).

    Sources, in order of preference: ``model.safetensors.index.json`` (sharded; every shard it
    names must exist and hold the keys the index assigns to it), ``model.safetensors``, else all
    ``*.safetensors`` files. Floating tensors are cast to ``dtype`` when given; only keys for
    which ``key_filter(key)`` is true are read.
    """
    path = Path(path)
    keep = key_filter or (lambda _key: True)
    plan = _plan_reads(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file, keys in plan.items():
        for key, tensor in _read_file(file, keys, keep):
            if key in state_dict:
                raise ModelLoadError(
                    f"tensor {key!r} appears in more than one safetensors file of {path} (again in {file.name})"
                )
            state_dict[key] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return state_dict


def sha256_of_weights(path_or_file: Path | str) -> str:
    """Hex sha256 identifying a checkpoint's weights (files are streamed, nothing cached).

    A file (e.g. a GGUF): the sha256 of its bytes. A directory: the sha256 over the sorted
    ``(file name, file sha256)`` pairs of its ``*.safetensors`` files.
    """
    path = Path(path_or_file)
    if path.is_file():
        return sha256_file(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ModelLoadError(
            f"cannot hash weights of {path}: expected a GGUF file or a directory with *.safetensors files"
        )
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def sha256_file(file: Path) -> str:
    """Hex sha256 of one file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- private helpers --------------------------------------------------------------------------


def _read_json(file: Path, *, required: bool):
    if not file.is_file():
        if required:
            raise ModelLoadError(
                f"{file.parent} has no {file.name}; a model path must be a GGUF file or a Hugging Face "
                f"model directory containing config.json and *.safetensors weights"
            )
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc


def _plan_reads(path: Path) -> dict[Path, list[str] | None]:
    """Which files to open, and the keys each must contain (``None``: all its keys)."""
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist or is not a directory")
    if (path / _INDEX_NAME).is_file():
        return _plan_from_index(path)
    if (path / _SINGLE_NAME).is_file():
        return {path / _SINGLE_NAME: None}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no safetensors weights (looked for {_INDEX_NAME}, {_SINGLE_NAME}, *.safetensors)"
        )
    return {file: None for file in files}


def _plan_from_index(path: Path) -> dict[Path, list[str]]:
    index = _read_json(path / _INDEX_NAME, required=True)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{path / _INDEX_NAME} has no \"weight_map\" object mapping tensor names to shard files")
    plan: dict[Path, list[str]] = {}
    for key, shard in weight_map.items():
        plan.setdefault(path / shard, []).append(key)
    missing = sorted(file.name for file in plan if not file.is_file())
    if missing:
        raise ModelLoadError(
            f"{path / _INDEX_NAME} names shard file(s) that do not exist in {path}: {', '.join(missing)}"
        )
    return plan


def _read_file(file: Path, expected: list[str] | None, keep: Callable[[str], bool]):
    """Yield ``(key, tensor)`` from one safetensors file, checking ``expected`` keys are there."""
    try:
        with safe_open(file, framework="pt") as f:
            present = set(f.keys())
            if expected is not None:
                absent = sorted(set(expected) - present)
                if absent:
                    raise ModelLoadError(
                        f"{file} lacks {len(absent)} tensor(s) that the index assigns to it, e.g. {absent[:3]}"
                    )
            for key in expected if expected is not None else sorted(present):
                if keep(key):
                    yield key, f.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"safetensors file {file} is truncated or corrupt: {exc}") from exc
