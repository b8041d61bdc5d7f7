"""model_type -> model class. Adding an architecture: add its file and one line here."""

from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.llama import LlamaForCausalLM
from mtplx.models.qwen2 import Qwen2ForCausalLM
from mtplx.models.qwen3 import Qwen3ForCausalLM
from mtplx.models.qwen3_5 import Qwen3_5ForCausalLM
from mtplx.models.qwen3_next import Qwen3NextForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
}


def build_model(config: ModelConfig) -> CausalLM:
    return FAMILIES[config.family](config)
