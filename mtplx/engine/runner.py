"""Tensors in, hidden states out: builds attention metadata for rows of sequences and runs
the trunk or the MTP head over them. Owns the KV tensors and the block accounting."""

from __future__ import annotations

import torch

from mtplx.engine.attention import AttentionMetadata
from mtplx.engine.block_manager import BlockManager
from mtplx.engine.kv_cache import PagedKVCache
from mtplx.engine.sequence import Sequence
from mtplx.models.base import CausalLM
from mtplx.models.mtp import MTPHead


class ModelRunner:
    def __init__(self, model: CausalLM, head: MTPHead | None, *, num_blocks: int, block_size: int = 16):
        cfg = model.config
        param = model.lm_head.weight
        self.model, self.head = model, head
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = PagedKVCache(
            num_layers=cfg.num_hidden_layers + (1 if head is not None else 0),
            num_blocks=num_blocks, block_size=block_size, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, hidden_size=cfg.hidden_size, dtype=self.dtype, device=self.device,
        )

    # -- metadata -----------------------------------------------------------------------
    def metadata(self, seqs: list[Sequence], starts: list[int], lens: list[int]) -> AttentionMetadata:
        """Row r holds lens[r] new tokens at sequence indices starts[r] .. starts[r]+lens[r]-1,
        padded to max(lens) (padding repeats the last position and writes to scratch)."""
        q = max(lens)
        bs = self.block_size
        positions, slots, tables = [], [], []
        for seq, start, n in zip(seqs, starts, lens):
            self.blocks.ensure_capacity(seq.seq_id, start + n)
            table = self.blocks.block_table(seq.seq_id)
            pos = list(range(start, start + n))
            slots.append([table[p // bs] * bs + p % bs for p in pos] + [self.cache.scratch_slot] * (q - n))
            positions.append(pos + [start + n - 1] * (q - n))
            tables.append(table[: (start + n + bs - 1) // bs])
        width = max(len(t) for t in tables)
        tables = [t + [self.cache.scratch_block] * (width - len(t)) for t in tables]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return AttentionMetadata(as_tensor(positions), as_tensor(slots), as_tensor(tables))

    def _pad(self, rows: list[list[int]], q: int) -> torch.Tensor:
        return torch.tensor([r + [r[-1]] * (q - len(r)) for r in rows], dtype=torch.long, device=self.device)

    # -- forwards -----------------------------------------------------------------------
    @torch.inference_mode()
    def trunk(self, seqs: list[Sequence], token_rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed token_rows[r] at sequence indices starts[r]... Returns hidden [rows, q, H]."""
        lens = [len(r) for r in token_rows]
        meta = self.metadata(seqs, starts, lens)
        return self.model(self._pad(token_rows, max(lens)), meta, self.cache)

    @torch.inference_mode()
    def head_forward(self, seqs: list[Sequence], hidden: torch.Tensor, token_rows: list[list[int]],
                     starts: list[int]) -> torch.Tensor:
        """MTP head over pairs (hidden[r, i], token_rows[r][i]); the pair's entry goes to the
        token's slot starts[r] + i. hidden: [rows, q, H]. Returns head output [rows, q, H]."""
        lens = [len(r) for r in token_rows]
        meta = self.metadata(seqs, starts, lens)
        return self.head(self.model, hidden, self._pad(token_rows, max(lens)), meta, self.cache)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
