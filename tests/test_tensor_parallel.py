"""Tensor parallelism (issue 20) on the CPU: two gloo ranks decode exactly what one process does.

Each model is drawn once per process from a seed (``random_loaded``) and sliced for its rank
(``shard_loaded``), so rank 0's engine with its mirror on rank 1 must commit, in float32, the
same greedy AR and MTP tokens as a one-process engine over the whole model: a dense Qwen3
(KV heads split), a hybrid Qwen3.5 (DeltaNet state and gated attention split by head, the MTP
head's state kept after partial acceptance) and a tied-embedding Llama whose one KV head is
replicated on both ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time

import pytest
import torch

from mtplx.engine.llm_engine import Engine
from mtplx.engine.tensor_parallel import RankFailed, check_world, launch
from mtplx.errors import InvalidParameter
from mtplx.loading.checkpoint import shard_loaded
from mtplx.loading.random_model import random_loaded
from mtplx.models.config import ModelConfig
from mtplx.models.parallel import Shard, local_config

SHAPES = {
    "dense": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
    # layers L L L F, as the real models interleave them
    "hybrid": dict(model_type="qwen3_5", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4, max_position_embeddings=256),
    "tied": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                 tie_word_embeddings=True, attention_bias=False),
}
# the third is longer than ROW_EXACT_QUERIES: its pairs reach the head through MTPHead.feed (mirrored)
PROMPTS = ([5, 9, 3, 17, 2, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], list(range(10, 34)))
NEW_TOKENS = 10
TIMEOUT_S = 30


def load_rank(kind: str, *, shard: Shard, device) -> object:
    """Rank ``shard.rank``'s slice of model ``kind`` (runs in every rank's process)."""
    return shard_loaded(random_loaded(SHAPES[kind], "cpu"), shard, device)


def decode(engine: Engine) -> list[list[int]]:
    """Greedy AR, then MTP at depths 1 and 3, for every prompt."""
    out = []
    for prompt in PROMPTS:
        out.append(engine.generate(prompt, mode="ar", max_tokens=NEW_TOKENS).token_ids)
        for depth in (1, 3):
            out.append(engine.generate(prompt, mode="mtp", depth=depth, max_tokens=NEW_TOKENS).token_ids)
    return out


@pytest.mark.parametrize("kind", ["dense", "hybrid", "tied"])
def test_two_ranks_decode_what_one_process_decodes(kind):
    alone = decode(Engine(random_loaded(SHAPES[kind], "cpu"), kv_cache_tokens=512, block_size=4))
    tp, loaded = launch(functools.partial(load_rank, kind), 2, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        engine = Engine(loaded, kv_cache_tokens=512, block_size=4, tensor_parallel=tp)
        assert loaded.model.config.num_attention_heads == SHAPES[kind]["num_attention_heads"] // 2
        assert decode(engine) == alone
    finally:
        tp.close()


def test_a_fused_feature_head_is_refused_and_the_ranks_stopped():
    """The ranks do not mirror a forge fuse3/prenorm head's forwards yet: the engine says so
    (naming the option) instead of decoding out of step, and stops the other ranks."""
    tp, loaded = launch(functools.partial(load_rank, "dense"), 2, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        loaded.head.mtp = dataclasses.replace(loaded.head.mtp, features="fuse3")
        with pytest.raises(InvalidParameter, match="fuse3.*tensor_parallel=1"):
            Engine(loaded, kv_cache_tokens=512, block_size=4, tensor_parallel=tp)
        for worker in tp.workers:
            worker.join(timeout=TIMEOUT_S)
            assert not worker.is_alive()
    finally:
        tp.close()


def test_a_killed_rank_is_reported_not_waited_for():
    tp, loaded = launch(functools.partial(load_rank, "dense"), 2, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        engine = Engine(loaded, kv_cache_tokens=512, block_size=4, tensor_parallel=tp)
        seen = []
        tp.watch(seen.append, interval_s=0.1)
        steps = engine.run(engine.make_request(PROMPTS[0], mode="ar", max_tokens=200, ignore_eos=True))
        next(steps)  # decoding is under way on both ranks
        os.kill(tp.workers[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 .* killed by signal 9") as err:
            for _ in steps:
                pass
        assert err.value.rank == 1 and time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e.rank for e in seen] == [1]  # the watchdog tells the server too
        with pytest.raises(RankFailed, match="rank 1"):  # and every later request fails at once
            engine.generate(PROMPTS[1], mode="ar", max_tokens=2)
    finally:
        tp.close()


@pytest.mark.parametrize("kind, overrides, world, message", [
    ("dense", {"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "6 attention heads"),
    ("dense", {"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "3 KV heads"),
    ("dense", {"vocab_size": 95}, 2, "95 vocabulary rows"),
    ("dense", {"intermediate_size": 126}, 4, "126 MLP channels"),
    ("hybrid", {}, 4, "2 linear-attention key heads"),
])
def test_shapes_that_do_not_divide_are_named(kind, overrides, world, message):
    config = ModelConfig.from_hf(dict(SHAPES[kind], **overrides))
    with pytest.raises(InvalidParameter, match=message):
        local_config(config, Shard(0, world))


def test_more_ranks_than_gpus_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this checks the message on a machine without GPUs")
    with pytest.raises(InvalidParameter, match="2 ranks need 2 GPUs, but 0 are visible"):
        check_world(2, torch.device("cuda"))
    with pytest.raises(InvalidParameter, match="integer >= 1"):
        check_world(0, torch.device("cpu"))


def test_quantized_weights_are_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """Tensor parallelism takes float weights: ``mtplx.load`` names the option that asks for
    quantized ones before it starts a rank (which would load its shard to find out)."""
    import mtplx
    from mtplx.engine import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(InvalidParameter, match="head_quantize='int8' cannot be sharded"):
        mtplx.load(str(tmp_path), device="cpu", tensor_parallel=2, head_quantize="int8")
    with pytest.raises(InvalidParameter, match="quantize='int4' cannot be sharded"):
        mtplx.load(str(tmp_path), device="cpu", tensor_parallel=2, quantize="int4")
    with pytest.raises(InvalidParameter, match="'int3' is not one of"):
        mtplx.load(str(tmp_path), device="cpu", tensor_parallel=2, quantize="int3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}))
    with pytest.raises(InvalidParameter, match="awq checkpoint: tensor parallelism needs float weights"):
        mtplx.load(str(tmp_path), device="cpu", tensor_parallel=2)


def test_the_server_exits_non_zero_naming_a_rank_that_died(tmp_path):
    import json
    import re

    from safetensors.torch import save_file

    from tests.serve_process import ServeProcess

    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SHAPES["dense"]))
    loaded = random_loaded(SHAPES["dense"], "cpu", head=False)
    save_file({k: v.contiguous() for k, v in loaded.model.state_dict().items()}, model_dir / "model.safetensors")
    server = ServeProcess(tmp_path, "--model", str(model_dir), "--device", "cpu", "--tensor-parallel", "2")
    try:
        server.wait_ready(timeout=120)
        import httpx

        body = {"model": "tiny", "prompt": [5, 9, 3], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        pid = int(re.search(r"rank 1 pid (\d+)", server.output).group(1))
        os.kill(pid, signal.SIGKILL)
        assert server.wait_exit(timeout=30) != 0
        assert re.search(r"rank 1 \(pid \d+\) exited killed by signal 9", server.output)
    finally:
        server.kill()

