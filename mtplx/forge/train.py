"""Self-distillation of an MTP head against the frozen trunk.

Loss at depth d, position t: KL(trunk's next-token distribution at t+d || head's distribution
from pair t at depth d), over completion tokens only (the prompt is context, not a target),
summed over depths with ``DEPTH_WEIGHTS``. The trunk's hidden states are computed once per
batch (they never change) and kept on the device; its logits are recomputed from them each
step, in float32, outside autocast.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from mtplx.forge.data import Sample
from mtplx.forge.dense import head_outputs, select_features, trunk_hidden
from mtplx.models.base import CausalLM
from mtplx.models.config import MTPConfig
from mtplx.models.mtp import MTPHead

DEPTH_WEIGHTS = (1.0, 0.7, 0.5, 0.4)  # depth 1 matters most: every later draft needs it accepted
VALIDATION_EVERY = 50  # one prompt in this many is held out of training, with all its samples


@dataclass
class TrainSettings:
    depth: int = 3
    lr: float = 1e-3
    epochs: float = 3.0
    batch_tokens: int = 8192
    max_len: int = 1024
    warmup_frac: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 100
    start_from: str = ""  # a forged head's folder to continue training from ("": the trunk's last layer)
    start_sha256: str = ""  # that head's weights' sha256, recorded in the provenance


@dataclass
class Batch:
    ids: torch.Tensor  # [rows, T] long
    hidden: torch.Tensor  # [rows, T, H * (1 + len(layers))] trunk final-normed states, then ``layers``' outputs
    lengths: torch.Tensor  # [rows] long
    prompt_lens: torch.Tensor  # [rows] long
    layers: tuple[int, ...] = ()  # trunk layers whose outputs ``hidden`` holds (dense.trunk_hidden)

    @property
    def target_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).clamp(min=0).sum())

    def final(self) -> torch.Tensor:
        """[rows, T, H] the trunk's final-normed hidden states (its logits' input)."""
        return self.hidden[..., : self.hidden.shape[-1] // (1 + len(self.layers))]

    def features(self, head: MTPHead) -> torch.Tensor:
        """[rows, T, head.trunk_width] what ``head`` reads of the trunk."""
        return select_features(self.hidden, self.layers, head.trunk_layers)


@dataclass
class TrainState:
    step: int = 0
    total_steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # {"step", "loss", "agreement": [per depth]}


def split_samples(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(train, validation): the samples of a fixed ~2% of the prompts, chosen by the prompt's
    tokens, never trained on: a prompt's completions at every temperature and round fall on one
    side (a split by sample would validate on prompts the head trained on)."""
    val = [s for s in samples if zlib.crc32(s.group.encode()) % VALIDATION_EVERY == 0]
    if not val and len(samples) > 1:
        val = samples[:1]
    val_keys = {id(s) for s in val}
    return [s for s in samples if id(s) not in val_keys], val


def make_batches(samples: list[Sample], batch_tokens: int, max_len: int) -> list[list[Sample]]:
    """Group samples of similar length so rows * longest <= batch_tokens (a long one goes alone)."""
    usable = [s for s in samples if s.completion_tokens > 0 and len(s.tokens) >= 2]
    ordered = sorted(usable, key=lambda s: min(len(s.tokens), max_len))
    batches, current = [], []
    for s in ordered:
        longest = min(len(s.tokens), max_len)
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def prepare_batch(samples: list[Sample], trunk: CausalLM, max_len: int, layers: tuple[int, ...] = ()) -> Batch:
    """Pad, move to the trunk's device and run the trunk once (keeping the outputs of ``layers``:
    the feature layers of the heads to train, ``MTPHead.trunk_layers``, or several heads' union)."""
    device = trunk.lm_head.weight.device
    length = min(max(len(s.tokens) for s in samples), max_len)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    for r, s in enumerate(samples):
        row = s.tokens[:length]
        ids[r, : len(row)] = torch.tensor(row)
    ids = ids.to(device)
    lengths = torch.tensor([min(len(s.tokens), length) for s in samples], device=device)
    prompt_lens = torch.tensor([s.prompt_len for s in samples], device=device)
    return Batch(ids, trunk_hidden(trunk, ids, layers), lengths, prompt_lens, tuple(layers))


def init_head(trunk: CausalLM, device, mtp: MTPConfig | None = None) -> MTPHead:
    """A float32 head that starts close to the trunk's own next-token predictor, so training begins
    from a calibrated distribution rather than confident noise: fc passes the normed trunk hidden
    state through, and the decoder layers (copies of the trunk's last one) have zeroed output
    projections, so they add nothing yet. The output is then h / rms(h) for the trunk's h: the
    trunk's own logits at a mildly changed temperature. A head reading the pre-norm state (or
    fused layers, whose fc starts as the last layer's) starts with the final norm's weight as
    its hidden-input norm's, which makes that input the final-normed state again."""
    mtp = mtp or MTPConfig(layout="sidecar")
    head = MTPHead(trunk, replace(mtp, draft_vocab=0)).to(device, torch.float32)  # drafts prune after training
    h = trunk.config.hidden_size
    with torch.no_grad():
        for layer in head.layers:
            shapes = {k: v.shape for k, v in layer.state_dict().items()}
            # a narrower MLP (``second_mlp``) takes the first rows of gate and up (its down
            # projection is zeroed below, so which ones does not change the start)
            layer.load_state_dict({k: v[tuple(slice(n) for n in shapes[k])].float()
                                   for k, v in trunk.model.layers[-1].state_dict().items()})
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h, device=device)  # [embedding, hidden] order: the hidden half
        if mtp.features != "final":
            head.pre_fc_norm_hidden.weight.copy_(trunk.model.norm.weight.float())
        if mtp.features == "fuse3":  # [low, middle, last]: the last layer's block passes through
            head.feature_fc.weight.zero_()
            head.feature_fc.weight[:, -h:] = torch.eye(h, device=device)
    head.requires_grad_(True)
    return head.train()


def depth_losses(head: MTPHead, trunk: CausalLM, batch: Batch, depth: int) -> tuple[list, list]:
    """Per depth: (KL summed over target tokens / their count, top-1 agreement with the trunk)."""
    device_type = batch.ids.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        outs = head_outputs(head, trunk, batch.features(head), batch.ids, depth)
    length = batch.ids.shape[1]
    kls, agreements = [], []
    for d, out in enumerate(outs, start=1):
        pos = torch.arange(d, length, device=batch.ids.device)  # target positions t + d
        mask = (pos[None] < batch.lengths[:, None]) & (pos[None] >= batch.prompt_lens[:, None] - 1)
        if not bool(mask.any()):  # host sync, once per depth: empty batches are rare
            break
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            student = F.log_softmax(trunk.compute_logits(out[:, : length - d][mask]), dim=-1)
        with torch.no_grad():
            teacher = F.log_softmax(trunk.compute_logits(batch.final()[:, d:][mask].float()), dim=-1)
        kls.append(F.kl_div(student, teacher, log_target=True, reduction="batchmean"))
        agreements.append((student.argmax(-1) == teacher.argmax(-1)).float().mean().detach())
    return kls, agreements


def learning_rate(step: int, total: int, peak: float, warmup_frac: float) -> float:
    """Linear warm-up (at least 20 steps, at most a quarter of the run: Adam's first steps move
    every weight by about the learning rate), then cosine decay to a tenth of the peak."""
    warmup = max(1, min(max(20, int(total * warmup_frac)), total // 4))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(head: MTPHead, trunk: CausalLM, batches: list[Batch], depth: int) -> list[float]:
    """Top-1 agreement with the trunk per depth, weighted by target tokens (teacher-forced)."""
    head.eval()
    sums, weights = [0.0] * depth, [0.0] * depth
    for batch in batches:
        _, agreements = depth_losses(head, trunk, batch, depth)
        for d, a in enumerate(agreements):
            sums[d] += float(a) * batch.target_tokens
            weights[d] += batch.target_tokens
    head.train()
    return [s / w if w else 0.0 for s, w in zip(sums, weights)]


class Trainer:
    """Owns the head, optimizer and schedule; ``run`` trains until the planned steps or a deadline."""

    def __init__(self, head: MTPHead, trunk: CausalLM, train: list[Batch], val: list[Batch],
                 settings: TrainSettings, checkpoint: Path | None = None):
        self.head, self.trunk, self.train_batches, self.val_batches = head, trunk, train, val
        self.s = settings
        self.checkpoint = checkpoint
        self.opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                     weight_decay=settings.weight_decay)
        self.planned = max(1, round(settings.epochs * len(train)))  # steps the epochs ask for
        self.state = TrainState(total_steps=self.planned)
        self.weights = DEPTH_WEIGHTS[: settings.depth] if settings.depth <= len(DEPTH_WEIGHTS) else \
            DEPTH_WEIGHTS + (DEPTH_WEIGHTS[-1],) * (settings.depth - len(DEPTH_WEIGHTS))

    # -- checkpoints -----------------------------------------------------------------------
    def save(self) -> None:
        if self.checkpoint is None:
            return
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "optimizer": self.opt.state_dict(),
                    "state": self.state.__dict__}, tmp)
        tmp.replace(self.checkpoint)

    def resume(self) -> bool:
        """Load the last checkpoint, if there is one. Returns whether it did."""
        if self.checkpoint is None or not self.checkpoint.is_file():
            return False
        raw = torch.load(self.checkpoint, map_location=self.trunk.lm_head.weight.device, weights_only=True)
        self.head.load_state_dict(raw["head"])
        self.opt.load_state_dict(raw["optimizer"])
        self.state = TrainState(**raw["state"])
        return True

    # -- training ----------------------------------------------------------------------------
    def _fit_to_deadline(self, deadline: float, now: float, since_step: int, since_time: float,
                         at_least: int = 1) -> None:
        """Plan as many steps as fit before the deadline at the step time measured since
        ``since_step`` (at least ``at_least`` more, never more than the epochs ask for)."""
        per_step = (now - since_time) / max(1, self.state.step - since_step)
        fits = self.state.step + max(at_least, int((deadline - now) / per_step))
        self.state.total_steps = min(self.planned, fits)

    def batch_for(self, step: int) -> Batch:
        """Epoch e visits every batch once, in an order fixed by (seed, e)."""
        n = len(self.train_batches)
        g = torch.Generator().manual_seed(self.s.seed * 7919 + step // n)
        return self.train_batches[int(torch.randperm(n, generator=g)[step % n])]

    def step(self) -> float:
        st = self.state
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(st.step, st.total_steps, self.s.lr, self.s.warmup_frac)
        batch = self.batch_for(st.step)
        kls, _ = depth_losses(self.head, self.trunk, batch, self.s.depth)
        loss = sum(w * kl for w, kl in zip(self.weights, kls))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.s.grad_clip)
        self.opt.step()
        st.step += 1
        st.tokens_seen += batch.target_tokens
        return float(loss.detach())  # host sync, once per step: the progress bar shows it

    def run(self, deadline: float | None = None, on_step: Callable[[float, list[float] | None], None] | None = None):
        """Train until ``total_steps`` or ``deadline`` (time.monotonic()). With a deadline the plan
        is fitted to the time left, so the learning rate still anneals: first from the first five
        steps (slow: they include warm-up), then every 25 steps from the step time since then."""
        st = self.state
        start, first = time.monotonic(), st.step
        steady = None  # (step, time) after the warm-up steps
        while st.step < st.total_steps:
            loss = self.step()
            now = time.monotonic()
            done = st.step - first
            if deadline and done == 5:
                steady = (st.step, now)
                self._fit_to_deadline(deadline, now, first, start, at_least=25)  # reach the steady re-plan
            elif deadline and steady and done % 25 == 5:
                self._fit_to_deadline(deadline, now, *steady)
            agreement = None
            if st.step == 1 or st.step % self.s.eval_every == 0 or st.step == st.total_steps:
                agreement = evaluate(self.head, self.trunk, self.val_batches, self.s.depth)
                st.history.append({"step": st.step, "loss": loss, "agreement": agreement})
            if on_step:
                on_step(loss, agreement)
            if st.step % self.s.checkpoint_every == 0:
                self.save()
            if deadline and now > deadline:
                break
        st.seconds += time.monotonic() - start
        self.save()
        return st
