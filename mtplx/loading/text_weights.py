"""Hybrid checkpoints (Qwen3-Next, Qwen3.5) as stored on disk -> the module names of
models/hybrid.py.

- Qwen3.5 keeps its text model under ``model.language_model.*`` beside a vision tower
  (``model.visual.*``): the text keys become ``model.*``; vision tensors are dropped (text only).
- The MTP head stays under ``mtp.*`` (loading/mtp_weights.py maps it).
- Qwen3-Next stores one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ...): they are
  stacked into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I].
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch

from mtplx.errors import ModelLoadError

log = logging.getLogger(__name__)

_TEXT_PREFIX = "model.language_model."
_VISION_PREFIXES = ("model.visual.", "visual.")
_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def text_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename, drop and stack as described in the module docstring; other keys pass unchanged."""
    out, vision = {}, 0
    for key, tensor in state.items():
        if key.startswith(_VISION_PREFIXES):
            vision += 1
            continue
        if key.startswith(_TEXT_PREFIX + "mtp."):
            key = key[len(_TEXT_PREFIX):]
        elif key.startswith(_TEXT_PREFIX):
            key = "model." + key[len(_TEXT_PREFIX):]
        out[key] = tensor
    if vision:
        log.info("ignoring %d vision tensors (model.visual.*): mtplx runs the text model only", vision)
    return stack_experts(out)


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert SwiGLU weights -> stacked ``gate_up_proj`` / ``down_proj`` per MoE layer."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for key, tensor in state.items():
        match = _EXPERT_KEY.match(key)
        if match:
            groups[match.group(1)][int(match.group(2))][match.group(3)] = tensor
        else:
            out[key] = tensor
    for prefix, experts in groups.items():
        count = max(experts) + 1
        missing = [e for e in range(count) if len(experts.get(e, {})) != 3]
        if missing:
            raise ModelLoadError(f"{prefix}: expert {missing[0]} lacks one of gate_proj, up_proj, down_proj")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(count)])
        out[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(count)])
    return out
