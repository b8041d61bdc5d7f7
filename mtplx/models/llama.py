"""Llama family (Llama 2/3, SmolLM2, Mistral-style dense): plain GQA; attention_bias puts a bias on q, k, v and o."""

from mtplx.models.base import CausalLM
from mtplx.models.config import ModelConfig
from mtplx.models.layers import Attention


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def make_attention(config: ModelConfig) -> Attention:
        return Attention(config, qkv_bias=config.attention_bias, qk_norm=False,
                         o_bias=config.attention_bias)
