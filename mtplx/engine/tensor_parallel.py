"""Tensor parallelism across processes: rank 0 runs the engine, the other ranks mirror its forwards.

One process per device (``launch`` starts ranks 1..N-1 itself; the caller is rank 0). Each
holds its slice of the weights (models/parallel.py) and caches with its own heads.

Why mirror forwards rather than run the engine on every rank: rank 0 alone owns HTTP,
scheduling, block tables, sampling and acceptance, so the other ranks need no copy of state
that depends on timing (batch windows, cancellations), on the host (grammars, stop strings) or
on random generators. Every model call rank 0's runner makes (a trunk or head forward, logits,
draft logits) and every change it makes to the recurrent state outside a forward (a slot zeroed
at admission, the accepted prefix of a verify kept, a snapshot restored) is first sent to the
other ranks as a command: its name and its inputs (token ids, hidden states, attention
metadata). Every rank then runs the same sharded forward, whose collectives meet. What rank 0
sampled and accepted (drafts, accepted counts, the next token) reaches the other ranks as the
inputs of the forwards that follow (the tokens fed, the slots written, the state kept), so
every rank's cache holds the same tokens. The exact-sampling path is untouched: it runs on
rank 0 alone, on logits every rank gathered.

Commands travel in two parts: a small header (name, shapes, integers) through a pipe to each
rank, which a rank waits on for as long as the server idles; then the tensors by broadcast
(one for all integer tensors, one for a hidden state) over the process group, on the device
(NCCL on CUDA, gloo on the CPU).

A rank that dies is noticed before each command (its process has exited) and when a command or
collective fails; either way ``RankFailed`` names the rank. A watchdog thread (``watch``) tells
the server when a rank dies while it idles. A rank whose rank 0 is gone (its pipe closes)
exits. Collectives time out after ``timeout_s`` (a rank that hangs without exiting).

CUDA graphs are not used under tensor parallelism yet: a graph replay on rank 0 would have to be
a command too, with the other ranks replaying the same captured graph (NCCL collectives can be
captured, but that is untested here). Forwards run eagerly on every rank.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtplx.cache.attention import AttentionMetadata
from mtplx.errors import InvalidParameter
from mtplx.models.parallel import Shard

log = logging.getLogger("mtplx.tensor_parallel")

DEFAULT_TIMEOUT_S = 300.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot go on."""

    def __init__(self, rank: int | None, message: str):
        super().__init__(message)
        self.rank = rank


# -- the command channel ----------------------------------------------------------------------
class Channel:
    """Rank 0's sending end (``send``) or another rank's receiving end (``recv``)."""

    def __init__(self, conns: list, device: torch.device, dtype: torch.dtype):
        self.conns, self.device, self.dtype = conns, device, dtype

    def send(self, op: str, ints: list[torch.Tensor | None] = (), hidden: torch.Tensor | None = None,
             args: tuple = ()) -> None:
        """Command ``op`` to every other rank: integer tensors (None allowed), at most one
        hidden-state tensor, plain Python ``args``."""
        shapes = [None if t is None else tuple(t.shape) for t in ints]
        header = (op, shapes, None if hidden is None else tuple(hidden.shape), args)
        for conn in self.conns:
            conn.send(header)
        present = [t.reshape(-1) for t in ints if t is not None]
        if present:
            dist.broadcast(torch.cat(present).to(torch.long).contiguous(), src=0)
        if hidden is not None:
            dist.broadcast(hidden.to(self.dtype).contiguous(), src=0)

    def recv(self) -> tuple[str, list[torch.Tensor | None], torch.Tensor | None, tuple]:
        """The next command (blocks until rank 0 sends one; EOFError once rank 0 is gone)."""
        op, shapes, hidden_shape, args = self.conns[0].recv()
        sizes = [0 if s is None else int(torch.Size(s).numel()) for s in shapes]
        ints: list[torch.Tensor | None] = []
        if sum(sizes):
            flat = torch.empty(sum(sizes), dtype=torch.long, device=self.device)
            dist.broadcast(flat, src=0)
            at = 0
            for shape, n in zip(shapes, sizes):
                ints.append(None if shape is None else flat[at: at + n].view(shape))
                at += n
        else:
            ints = [None if s is None else torch.empty(s, dtype=torch.long, device=self.device) for s in shapes]
        hidden = None
        if hidden_shape is not None:
            hidden = torch.empty(hidden_shape, dtype=self.dtype, device=self.device)
            dist.broadcast(hidden, src=0)
        return op, ints, hidden, args


def _meta_tensors(meta: AttentionMetadata) -> list[torch.Tensor | None]:
    return [meta.positions, meta.slot_mapping, meta.block_tables, meta.state_slots, meta.query_lens]


def _meta_args(meta: AttentionMetadata) -> tuple:
    return meta.key_start, meta.capture


def _meta_from(ints: list[torch.Tensor | None], args: tuple) -> AttentionMetadata:
    positions, slots, tables, state_slots, query_lens = ints
    return AttentionMetadata(positions, slots, tables, key_start=args[0], state_slots=state_slots,
                             query_lens=query_lens, capture=args[1])


# -- rank 0: the runner's model, head and state cache, mirrored --------------------------------
class MirroredModel:
    """Rank 0's trunk as the runner sees it: each forward and logits call is first sent to the
    other ranks. Everything else (config, modules) is the sharded model's own."""

    def __init__(self, model, group: "TensorParallel"):
        self.inner, self.group = model, group

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids: torch.Tensor, meta: AttentionMetadata, cache, layers=None) -> torch.Tensor:
        """layers: the trunk layers whose outputs a fused-feature head reads (forge's fuse3), or None."""
        run = (lambda: self.inner(ids, meta, cache, layers)) if layers else (lambda: self.inner(ids, meta, cache))
        return self.group.run("trunk", run, [ids, *_meta_tensors(meta)],
                              args=(*_meta_args(meta), tuple(layers) if layers else None))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.run("logits", lambda: self.inner.compute_logits(hidden), hidden=hidden)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.run("draft_logits", lambda: self.inner.compute_draft_logits(hidden), hidden=hidden)


class MirroredHead:
    """Rank 0's MTP head as the runner sees it (``MirroredModel``'s twin)."""

    def __init__(self, head, group: "TensorParallel"):
        self.inner, self.group = head, group

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, trunk: MirroredModel, hidden: torch.Tensor, ids: torch.Tensor, meta: AttentionMetadata,
                 cache) -> torch.Tensor:
        return self.group.run("head", lambda: self.inner(trunk.inner, hidden, ids, meta, cache),
                              [ids, *_meta_tensors(meta)], hidden=hidden, args=_meta_args(meta))

    def feed(self, trunk: MirroredModel, hidden: torch.Tensor, ids: torch.Tensor, meta: AttentionMetadata,
             cache) -> None:
        self.group.run("head_feed", lambda: self.inner.feed(trunk.inner, hidden, ids, meta, cache),
                       [ids, *_meta_tensors(meta)], hidden=hidden, args=_meta_args(meta))


class MirroredStates:
    """Rank 0's recurrent-state cache: the operations that change state outside a forward are
    sent to the other ranks too (their caches have the same slots, with their own heads)."""

    def __init__(self, states, group: "TensorParallel"):
        self.inner, self.group = states, group

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def allocate(self) -> int:
        slot = self.inner.allocate()
        self.group.run("state_allocate", lambda: None, args=(slot,))
        return slot

    def commit_captured(self, slots: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> None:
        self.group.run("state_commit_captured", lambda: self.inner.commit_captured(slots, kept, rows),
                       [slots, kept, rows])

    def discard_captured(self) -> None:
        self.group.run("state_discard_captured", self.inner.discard_captured)

    def snapshot(self, slots: torch.Tensor):
        return self.group.run("state_snapshot", lambda: self.inner.snapshot(slots), [slots])

    def restore(self, slots: torch.Tensor, snapshot, rows: torch.Tensor) -> None:
        # the other ranks restore from their own last snapshot (the runner restores only that one)
        self.group.run("state_restore", lambda: self.inner.restore(slots, snapshot, rows), [slots, rows])


class TensorParallel:
    """Rank 0's handle on the other ranks: their processes, the command channel, the watchdog."""

    def __init__(self, world: int, workers: list, channel: Channel):
        self.world, self.workers, self.channel = world, workers, channel
        self.failure: RankFailed | None = None
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def mirror(self, runner) -> None:
        """Route ``runner``'s model, head and state cache through the other ranks (before the
        KV allocator takes the state cache), and have every rank build caches of the same
        geometry."""
        self.run("setup", lambda: None, args=(runner.blocks.num_blocks, runner.block_size, runner.state_commit,
                                              runner.cache.kv_dtype))
        runner.model = MirroredModel(runner.model, self)
        if runner.head is not None:
            runner.head = MirroredHead(runner.head, self)
        if runner.states is not None:
            runner.states = runner.cache.states = MirroredStates(runner.states, self)

    def run(self, op: str, local: Callable, ints: list = (), hidden: torch.Tensor | None = None, args: tuple = ()):
        """Send command ``op``, then run ``local()`` (rank 0's share of it). A dead rank, a
        failed send or a failed collective raises ``RankFailed`` naming the rank."""
        self.check()
        try:
            self.channel.send(op, list(ints), hidden, args)
            return local()
        except RankFailed:
            raise
        except (RuntimeError, OSError, EOFError) as exc:  # gloo/NCCL errors are RuntimeErrors
            raise self._failed(exc) from exc

    def check(self) -> None:
        """Raise ``RankFailed`` if a rank has died (or one did before)."""
        if self.failure is not None:
            raise self.failure
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                self.failure = RankFailed(rank, f"tensor-parallel rank {rank} (pid {proc.pid}) exited "
                                                f"{_exit_text(proc.exitcode)}; the engine cannot continue")
                raise self.failure

    def _failed(self, exc: BaseException) -> RankFailed:
        """The error for a failed command: the rank whose process has exited (waiting up to 2 s
        for the exit to show), else the collective's own error."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except RankFailed as failure:
                return failure
            time.sleep(0.05)
        self.failure = RankFailed(None, f"a tensor-parallel collective failed ({exc}); no rank has exited, so "
                                        "one may hang; the engine cannot continue")
        return self.failure

    def watch(self, on_failure: Callable[[RankFailed], None], interval_s: float = 0.5) -> None:
        """Start a daemon thread that calls ``on_failure(error)`` once when a rank dies (also
        while nothing runs)."""
        def loop():
            while not self._closed:
                try:
                    self.check()
                except RankFailed as failure:
                    log.error("%s", failure)
                    on_failure(failure)
                    return
                time.sleep(interval_s)

        self._watchdog = threading.Thread(target=loop, name="mtplx-tp-watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            for conn in self.channel.conns:
                try:
                    conn.send(("stop", [], None, ()))
                except OSError:
                    pass
        for proc in self.workers:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=5)
        if dist.is_initialized() and self.failure is None:  # with a rank gone it could wait for that rank
            dist.destroy_process_group()


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"with code {code}"


# -- starting the ranks --------------------------------------------------------------------------
def check_world(world: int, device: torch.device) -> None:
    """Errors a user can cause before anything starts: a bad count, more ranks than GPUs."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidParameter("tensor_parallel", f"must be an integer >= 1, got {world!r}")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise InvalidParameter("tensor_parallel", f"{world} ranks need {world} GPUs, but {torch.cuda.device_count()} "
                                                  "are visible (CUDA_VISIBLE_DEVICES)")


def launch(load: Callable, world: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Start ranks 1..world-1 (spawned processes, one per device) and join them as rank 0.

    load(shard=Shard, device=torch.device) -> LoadedModel: each rank's slice of the model on
    its device (picklable: it runs in every rank). Returns (TensorParallel, rank 0's
    LoadedModel); build the Engine from them (``Engine(loaded, tensor_parallel=...)``)."""
    check_world(world, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    address = f"tcp://127.0.0.1:{_free_port()}"
    # CUDA cannot be forked; on the CPU a fork starts in a moment with everything imported
    ctx = mp.get_context("spawn" if device.type == "cuda" else "fork")
    workers, conns = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, name=f"mtplx-tp-rank{rank}", daemon=True,
                           args=(rank, world, address, backend, device.type, load, timeout_s, theirs,
                                 torch.get_num_threads()))
        proc.start()
        theirs.close()
        workers.append(proc)
        conns.append(ours)
    try:
        dev = _rank_device(device, 0)
        dist.init_process_group(backend, init_method=address, rank=0, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        loaded = load(shard=Shard(0, world), device=dev)
    except BaseException:
        for proc in workers:
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return TensorParallel(world, workers, Channel(conns, dev, loaded.model.model.embed_tokens.weight.dtype)), loaded


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world: int, address: str, backend: str, device_type: str, load: Callable,
                 timeout_s: float, conn, threads: int) -> None:
    """A rank other than 0: join the group, load its slice, then run commands until told to
    stop or until rank 0 is gone."""
    torch.set_num_threads(threads)
    dev = _rank_device(torch.device(device_type), rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    loaded = load(shard=Shard(rank, world), device=dev)
    Worker(loaded.model, loaded.head, Channel([conn], dev, loaded.model.model.embed_tokens.weight.dtype)).serve()
    dist.destroy_process_group()


class Worker:
    """A rank other than 0: runs each command rank 0 sends on its own shard and caches."""

    def __init__(self, model, head, channel: Channel):
        self.model, self.head, self.channel = model, head, channel
        self.runner = None  # built by the "setup" command: caches of rank 0's geometry
        self._snapshot = None

    @torch.inference_mode()
    def serve(self) -> None:
        while True:
            try:
                op, ints, hidden, args = self.channel.recv()
            except EOFError:  # rank 0 is gone
                os._exit(1)
            if op == "stop":
                return
            getattr(self, "_" + op)(ints, hidden, args)

    def _setup(self, ints, hidden, args) -> None:
        from mtplx.engine.runner import ModelRunner

        num_blocks, block_size, state_commit, kv_dtype = args
        self.runner = ModelRunner(self.model, self.head, num_blocks=num_blocks, block_size=block_size,
                                  state_commit=state_commit, kv_dtype=kv_dtype)

    def _trunk(self, ints, hidden, args) -> None:
        layers = args[2]
        extra = (layers,) if layers else ()
        self.model(ints[0], _meta_from(ints[1:], args), self.runner.cache, *extra)

    def _head(self, ints, hidden, args) -> None:
        self.head(self.model, hidden, ints[0], _meta_from(ints[1:], args), self.runner.cache)

    def _head_feed(self, ints, hidden, args) -> None:
        self.head.feed(self.model, hidden, ints[0], _meta_from(ints[1:], args), self.runner.cache)

    def _logits(self, ints, hidden, args) -> None:
        self.model.compute_logits(hidden)

    def _draft_logits(self, ints, hidden, args) -> None:
        self.model.compute_draft_logits(hidden)

    def _state_allocate(self, ints, hidden, args) -> None:
        self.runner.states.zero(args[0])

    def _state_commit_captured(self, ints, hidden, args) -> None:
        self.runner.states.commit_captured(*ints)

    def _state_discard_captured(self, ints, hidden, args) -> None:
        self.runner.states.discard_captured()

    def _state_snapshot(self, ints, hidden, args) -> None:
        self._snapshot = self.runner.states.snapshot(ints[0])

    def _state_restore(self, ints, hidden, args) -> None:
        self.runner.states.restore(ints[0], self._snapshot, ints[1])
