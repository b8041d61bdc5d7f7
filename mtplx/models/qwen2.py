"""Qwen2 / Qwen2.5 (and the MiMo trunk): GQA with bias on q, k and v projections."""

from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.layers import Attention


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def make_attention(config: ModelConfig) -> Attention:
        return Attention(config, qkv_bias=True, qk_norm=False)
