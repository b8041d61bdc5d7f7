"""The forged head on disk: ``mtp.safetensors`` (keys ``mtp.<head module name>``, bf16 by default)
and ``mtplx_forge.json`` (provenance: trunk sha256, architecture, training, data, measurements).
loading/mtp_weights.py ``load_sidecar`` reads them back and checks the trunk hash."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from mtplx.loading.mtp_weights import SIDECAR_PROVENANCE, SIDECAR_WEIGHTS
from mtplx.models.mtp import MTPHead

FORMAT = "mtplx-forge/1"


def head_state(head: MTPHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's tensors under sidecar names, on the CPU, floating-point ones in ``dtype``
    (a draft vocabulary's ids as int32)."""
    return {f"mtp.{k}": v.detach().to("cpu", dtype if v.is_floating_point() else torch.int32).contiguous()
            for k, v in head.state_dict().items()}


def write_head(out_dir: Path, weights: dict[str, torch.Tensor], provenance: dict) -> Path:
    """Write ``weights`` (``head_state``'s) and the provenance into ``out_dir`` (created); each
    file is replaced atomically."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SIDECAR_WEIGHTS
    tmp = path.with_suffix(".tmp")
    save_file(weights, str(tmp), metadata={"format": FORMAT, "trunk_sha256": provenance["trunk_sha256"]})
    tmp.replace(path)
    dtype = next(v.dtype for v in weights.values() if v.is_floating_point())
    provenance = {**provenance, "format": FORMAT, "weights_sha256": _sha256(path),
                  "weights_dtype": str(dtype).replace("torch.", "")}
    write_provenance(out_dir, provenance)
    return out_dir


def read_provenance(head_dir: Path) -> dict:
    path = Path(head_dir) / SIDECAR_PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_provenance(head_dir: Path, provenance: dict) -> None:
    path = Path(head_dir) / SIDECAR_PROVENANCE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(provenance, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
