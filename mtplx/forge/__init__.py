"""Forge: train an MTP head for a trunk that has none, by self-distillation against the frozen trunk.

prompts.py (the prompt set and held-out prompts) -> data.py (the trunk's own generations, batched
through the engine) -> dense.py (the training forward, in the engine's exact conventions) ->
train.py (KL to the trunk's next-token distribution) -> measure.py (acceptance, exactness) ->
artifact.py (mtp.safetensors + mtplx_forge.json); build.py runs the phases, resumably.
self_prompts.py widens the prompt set with user messages the trunk writes itself.
"""

from mtplx.errors import MtplxError


class ForgeError(MtplxError):
    """A trunk or an option that forge cannot work with."""
