"""Tensor parallelism inside the model (Megatron-style): every rank holds a slice of each large
weight, and the layers sum or gather the slices' outputs over the ranks.

- column-parallel (no communication): q/k/v, gate/up and a Gated DeltaNet's input projections;
  a rank keeps the rows of its attention heads (KV heads: its share, or the one its query heads
  read when there are fewer KV heads than ranks), of its DeltaNet heads, of its intermediate
  channels. Each rank's model is simply built with fewer heads (``local_config``);
- row-parallel (``RowParallelLinear``): o, down and DeltaNet's out_proj; a rank multiplies its
  heads' outputs by its columns and one all-reduce sums the partial outputs (a bias is added
  once, by rank 0);
- vocabulary-parallel: a rank keeps V / N rows of the embedding (``VocabParallelEmbedding``: a
  lookup zeroes the ids other ranks own, then all-reduces) and of the output matrix
  (``VocabParallelLMHead``: each rank's logits all-gathered, so every rank holds [..., V]).
So a layer costs two all-reduces (attention, MLP) and a step one all-gather of logits.
Caches follow the heads: each rank's paged KV cache and recurrent state hold its own heads.

``parallelize`` swaps these layers into a model built from ``local_config``;
loading/sharding.py slices a checkpoint to match; engine/tensor_parallel.py runs the ranks.
Collectives go to torch.distributed's default group (NCCL on CUDA, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtplx.errors import InvalidParameter
from mtplx.kernels import gemv
from mtplx.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This process's place among ``world`` tensor-parallel ranks."""

    rank: int
    world: int

    def part(self, n: int) -> range:
        """The units (heads, channels, vocabulary rows) of n this rank owns: an equal share."""
        size = n // self.world
        return range(self.rank * size, (self.rank + 1) * size)

    def kv_part(self, heads: int, kv_heads: int) -> range:
        """The KV heads this rank keeps: its share, or, with fewer KV heads than ranks, the one
        its query heads read (replicated on world / kv_heads ranks)."""
        if kv_heads >= self.world:
            return self.part(kv_heads)
        first = self.part(heads).start // (heads // kv_heads)
        return range(first, first + 1)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's model: attention heads, KV heads, intermediate channels and
    DeltaNet heads divided by the world size (vocabulary and hidden size stay whole: the
    embedding and output layers are swapped for vocabulary-parallel ones by ``parallelize``).
    Raises InvalidParameter naming what does not divide."""
    n = shard.world
    if n == 1:
        return config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    checks = [("attention heads (num_attention_heads)", heads), ("vocabulary rows (vocab_size)", config.vocab_size),
              ("MLP channels (intermediate_size)", config.intermediate_size)]
    if config.linear is not None:
        checks += [("linear-attention key heads (linear_num_key_heads)", config.linear.num_key_heads),
                   ("linear-attention value heads (linear_num_value_heads)", config.linear.num_value_heads)]
    for what, count in checks:
        if count % n:
            raise InvalidParameter("tensor_parallel", f"{n} ranks cannot split this model's {count} {what}; "
                                                      f"use a tensor_parallel that divides {count}")
    if kv % n and n % kv:
        raise InvalidParameter("tensor_parallel", f"{n} ranks cannot split this model's {kv} KV heads "
                                                  f"(num_key_value_heads): the rank count must divide them or be a "
                                                  f"multiple of them")
    if config.moe is not None:
        raise InvalidParameter("tensor_parallel", "mixture-of-experts layers are not sharded yet: serve MoE "
                                                  "models with tensor_parallel 1")
    linear = config.linear
    if linear is not None:
        linear = replace(linear, num_key_heads=linear.num_key_heads // n, num_value_heads=linear.num_value_heads // n)
    return replace(config, num_attention_heads=heads // n, num_key_value_heads=max(kv // n, 1),
                   intermediate_size=config.intermediate_size // n, linear=linear)


class RowParallelLinear(nn.Linear):
    """A linear map over this rank's slice of the inputs: its partial outputs summed over the
    ranks by one all-reduce. Only rank 0 holds the bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight, self.bias))

    @staticmethod
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's ``partial`` (in place; callers that compute the
        partial product themselves, as the fused decode path does, call this)."""
        dist.all_reduce(partial)
        return partial


def reduce_partial(linear: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out``, computed with ``linear``'s weight outside its forward (the fused decode path),
    summed over ranks where ``linear`` is row-parallel; as it is otherwise."""
    return RowParallelLinear.reduce(out) if isinstance(linear, RowParallelLinear) else out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [vocab_start, vocab_start + rows) of the embedding; ids others own look
    up zeros, and one all-reduce adds the ranks' lookups (exact: every other term is zero)."""

    def __init__(self, rows: int, dim: int, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab_start = vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out)
        return out


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the output matrix; the logits of every rank all-gathered along the
    vocabulary, so each rank returns [..., V] (the weight may be the tied embedding's)."""

    def __init__(self, rows: int, dim: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.world = world

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if gemv.usable(hidden, self.weight):
            local = gemv.gemv(hidden, self.weight)
        else:
            local = F.linear(hidden, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)


_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")


def parallelize(module: nn.Module, shard: Shard, config: ModelConfig) -> nn.Module:
    """Swap the row-parallel and vocabulary-parallel layers into a (meta-device) trunk or MTP
    head built from ``local_config(config, shard)``; ``config`` is the whole model's. In place;
    returns ``module``."""
    if shard.world == 1:
        return module
    for name, sub in list(module.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in _ROW_PARALLEL and type(sub) is nn.Linear:
            row = RowParallelLinear(sub.in_features, sub.out_features, bias=sub.bias is not None and shard.rank == 0,
                                    device=sub.weight.device, dtype=sub.weight.dtype)
            module.set_submodule(name, row)
    vocab = shard.part(config.vocab_size)
    stack = getattr(module, "model", None)
    if stack is not None and isinstance(getattr(stack, "embed_tokens", None), nn.Embedding):
        with torch.device(stack.embed_tokens.weight.device):
            stack.embed_tokens = VocabParallelEmbedding(len(vocab), config.hidden_size, vocab.start)
            module.lm_head = VocabParallelLMHead(len(vocab), config.hidden_size, shard.world)
    return module
