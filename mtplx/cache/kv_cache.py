"""The tensors behind the paged KV cache (accounting lives in block_manager.py)."""

from __future__ import annotations

import torch


class PagedKVCache:
    """Key/value pools for every attention layer (trunk layers, then MTP head layers).

    k[layer], v[layer]: [num_blocks + 1, block_size, kv_heads, head_dim] in ``kv_dtype`` (default:
    the model's ``dtype``; on the CPU float16 halves what a long context's attention reads). The
    extra last block is scratch: padding tokens write there, and padded block-table entries point
    there.
    last_hidden: [num_blocks + 1, hidden] the trunk's final-normed hidden state at each block's
    last slot, in ``dtype``, so an MTP head can resume after a prefix-cache hit.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None):
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        self.kv_dtype = kv_dtype or dtype
        self.k = [torch.zeros(shape, dtype=self.kv_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=self.kv_dtype, device=device) for _ in range(num_layers)]
        self.last_hidden = torch.zeros(num_blocks + 1, hidden_size, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        # recurrent state of linear-attention layers (hybrid models; set by the runner), else None
        self.states = None

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def store_block_ends(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Keep hidden states that land on a block's last slot. hidden: [rows, q, H]; slots: [rows, q]."""
        slots = slot_mapping.reshape(-1)
        is_end = (slots % self.block_size) == self.block_size - 1
        blocks = torch.where(is_end, slots // self.block_size, self.scratch_block)
        self.last_hidden.index_copy_(0, blocks, hidden.reshape(-1, hidden.shape[-1]).to(self.last_hidden.dtype))
