"""Per-sequence recurrent state of linear-attention layers, beside the paged KV cache.

A Gated DeltaNet layer (models/gated_deltanet.py) keeps, per sequence, instead of a KV history:
  conv[layer]: [slots, conv_dim, kernel - 1]           the causal convolution's last inputs
  ssm[layer]:  [slots, v_heads, k_dim, v_dim] float32  the delta-rule state matrices
A sequence owns one slot from admission to release (``allocate`` / ``free``), the same
lifecycle as its KV blocks.

A state cannot be truncated like a KV cache. A verify forward over 1 + D tokens therefore runs
with ``AttentionMetadata.capture``: each layer keeps what it needs to rebuild its state after
any prefix of the verified tokens (``keep_captured``; an object with a
``state_after(kept, rows) -> (conv, ssm)`` method, models/gated_deltanet.py ``CapturedVerify``), and
``commit_captured`` writes the state at the accepted position into the slot, with no second
forward. ``snapshot`` / ``restore`` serve the fallback (restore the state from before the
verify and feed the accepted tokens again).
"""

from __future__ import annotations

import torch


class RecurrentStateCache:
    """Slots of conv and SSM state for ``num_layers`` linear-attention layers; doubles when full
    (a real model's state is ~100 MB per sequence, so it starts small)."""

    def __init__(self, *, num_layers: int, conv_dim: int, conv_width: int, v_heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device | str, capacity: int = 1):
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.conv_shape = (conv_dim, conv_width)
        self.ssm_shape = (v_heads, k_dim, v_dim)
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        self.capacity = 0
        self._free: list[int] = []
        # per layer, from the last capture forward: an object with state_after(kept, rows)
        self.captured: list = [None] * num_layers
        self._grow(capacity)

    @property
    def num_used_slots(self) -> int:
        return self.capacity - len(self._free)

    # -- lifecycle ------------------------------------------------------------------------
    def allocate(self) -> int:
        """A zeroed slot (the state before any token)."""
        if not self._free:
            self._grow(max(1, self.capacity))
        slot = self._free.pop()
        self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        """Reset a slot to the state before any token, growing the pool to hold it (another
        tensor-parallel rank's allocate: engine/tensor_parallel.py)."""
        if slot >= self.capacity:
            self._grow(slot + 1 - self.capacity)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[slot].zero_()
            ssm[slot].zero_()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"state slot {slot} is not allocated")
        self._free.append(slot)

    def _grow(self, extra: int) -> None:
        """Add ``extra`` slots (copies the existing state; happens at admission, never mid-step)."""
        def grown(old: list[torch.Tensor], shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
            new = [torch.zeros((self.capacity + extra, *shape), dtype=dtype, device=self.device)
                   for _ in range(self.num_layers)]
            for n, o in zip(new, old):
                n[: self.capacity] = o
            return new

        self.conv = grown(self.conv, self.conv_shape, self.dtype)
        self.ssm = grown(self.ssm, self.ssm_shape, torch.float32)
        self._free.extend(reversed(range(self.capacity, self.capacity + extra)))
        self.capacity += extra

    # -- used by the layers -----------------------------------------------------------------
    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [rows] long -> (conv [rows, conv_dim, width], ssm [rows, v_heads, k_dim, v_dim]) copies."""
        return self.conv[layer].index_select(0, slots), self.ssm[layer].index_select(0, slots)

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv[layer].index_copy_(0, slots, conv.to(self.dtype))
        self.ssm[layer].index_copy_(0, slots, ssm.float())

    def keep_captured(self, layer: int, captured) -> None:
        """captured.state_after(kept [n] long, rows [n] long) -> (conv [n, conv_dim, width], ssm [n, ...])."""
        self.captured[layer] = captured

    # -- used by the runner ------------------------------------------------------------------
    def commit_captured(self, slots: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep, for rows ``rows`` of the last capture forward, the state after their first
        kept tokens. slots, kept, rows: [n] long; kept in 1..q."""
        for layer, captured in enumerate(self.captured):
            if captured is None:
                raise RuntimeError("commit_captured without a capture forward (AttentionMetadata.capture)")
            self.write(layer, slots, *captured.state_after(kept, rows))
        self.discard_captured()

    def discard_captured(self) -> None:
        self.captured = [None] * self.num_layers

    def snapshot(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the rows' states, per layer."""
        return [self.read(layer, slots) for layer in range(self.num_layers)]

    def restore(self, slots: torch.Tensor, snapshot: list[tuple[torch.Tensor, torch.Tensor]],
                rows: torch.Tensor) -> None:
        """Put back ``snapshot`` rows ``rows`` (indices into the snapshot) into ``slots``."""
        for layer, (conv, ssm) in enumerate(snapshot):
            self.write(layer, slots, conv.index_select(0, rows), ssm.index_select(0, rows))
