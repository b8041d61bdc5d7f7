"""Qwen3 dense: GQA with per-head RMSNorm on queries and keys before RoPE."""

from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.layers import Attention


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def make_attention(config: ModelConfig) -> Attention:
        return Attention(config, qkv_bias=config.attention_bias, qk_norm=True, o_bias=config.attention_bias)
