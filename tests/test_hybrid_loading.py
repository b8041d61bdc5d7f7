"""Hybrid checkpoints in their real on-disk layouts load through ``mtplx.load``:
Qwen3.5 (text model under ``model.language_model.*``, a vision tower, ``mtp.*``, config under
``text_config``) and Qwen3-Next (flat config, one tensor per expert), sharded with an index."""

import json
import logging
import re

import pytest
import torch
from safetensors.torch import save_file

import mtplx
from mtplx.loading.describe import describe
from mtplx.models.config import ModelConfig
from tests.hybrid_models import hf_hybrid, hybrid_head, one_thread
from tests.tiny_models import ours_from_hf

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _write_sharded(folder, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> None:
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous().clone() for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors -> one tensor per expert, as Qwen3-Next stores them."""
    out = {}
    for key, t in state.items():
        match = re.match(r"(.*\.experts)\.(gate_up_proj|down_proj)$", key)
        if not match:
            out[key] = t
            continue
        for e in range(t.shape[0]):
            if match.group(2) == "down_proj":
                out[f"{match.group(1)}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)
                out[f"{match.group(1)}.{e}.gate_proj.weight"] = gate
                out[f"{match.group(1)}.{e}.up_proj.weight"] = up
    return out


def _check_engine(engine, hf, head) -> None:
    """Trunk logits equal transformers', the head's weights arrived, MTP greedy equals AR."""
    ids = list(range(5, 40))
    gen = engine.generator
    seq = engine.new_sequence(engine.make_request(ids, mode="ar", max_tokens=1))
    gen.admit(seq)
    logits = engine.runner.logits(engine.runner.trunk([seq], [ids], [0]))[0]
    gen.release(seq)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits - ref).abs().max() <= TOL
    loaded = engine.runner.head.state_dict()
    assert loaded.keys() == head.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in head.state_dict().items())
    assert engine.loaded.head_info["layout"] == "qwen3_next" and engine.runner.head.mtp.zero_centered_norms
    ar = engine.generate([1, 2, 3], mode="ar", max_tokens=12)
    assert engine.generate([1, 2, 3], mode="mtp", depth=3, max_tokens=12).token_ids == ar.token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_checkpoint_layout_loads(tmp_path, caplog, arch):
    hf, cfg = hf_hybrid(arch)
    head = hybrid_head(ours_from_hf(hf, cfg))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in hf.state_dict().items()}
    tensors.update({"mtp." + k: v for k, v in head.state_dict().items()})
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4)
    text = {k: v for k, v in cfg.items() if k not in ("tie_word_embeddings", "model_type")}
    config = {"model_type": arch, "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
              "text_config": {**text, "model_type": arch + "_text", "mtp_num_hidden_layers": 1},
              "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}}
    _write_sharded(tmp_path, tensors, config)

    with caplog.at_level(logging.INFO, logger="mtplx.loading.text_weights"):
        engine = mtplx.load(tmp_path, device="cpu", dtype="float32", kv_cache_tokens=512, block_size=4)
    assert "vision" in caplog.text
    assert engine.config.model_type == arch and engine.config.mtp.num_layers == 1
    _check_engine(engine, hf, head)

    info = describe(tmp_path)  # what `mtplx inspect` reports, from metadata alone
    assert info["tier"] == "verified" and info["mtp"]["layout"] == "qwen3_next"
    assert info["mtp"]["zero_centered_norms"] is True
    assert info["layer_mix"]["linear_attention"] > 0 and info["layer_mix"]["full_attention"] > 0
    assert info["prefix_cache"]["enabled"] is False and "recurrent state" in info["prefix_cache"]["reason"]
    full = info["layer_mix"]["full_attention"]  # only those layers keep keys and values
    assert info["kv_cache"]["attention_layers"] == full
    per = 2 * full * engine.config.num_key_value_heads * engine.config.head_dim
    assert info["kv_cache"]["bytes_per_token"] == {"float16": 2 * per, "float32": 4 * per}
    pools = engine.runner.cache.k[:full] + engine.runner.cache.v[:full]  # the engine's trunk pools (float16 here)
    assert sum(p[0, 0].numel() * p.element_size() for p in pools) == info["kv_cache"]["bytes_per_token"]["float16"]


def test_qwen3_next_checkpoint_with_per_expert_tensors_loads(tmp_path):
    hf, cfg = hf_hybrid("qwen3_next")
    head = hybrid_head(ours_from_hf(hf, cfg))
    tensors = _per_expert({**hf.state_dict(), **{"mtp." + k: v for k, v in head.state_dict().items()}})
    assert any(".experts.3.up_proj.weight" in k for k in tensors)
    layer_types = cfg.pop("layer_types")  # written the old way: an interval
    _write_sharded(tmp_path, tensors, {**cfg, "full_attention_interval": 4, "num_nextn_predict_layers": 1})
    engine = mtplx.load(tmp_path, device="cpu", dtype="float32", kv_cache_tokens=512, block_size=4)
    assert engine.config.layer_types == tuple(layer_types)
    _check_engine(engine, hf, head)


def test_real_qwen3_5_text_config_fields():
    """A Qwen3.5 config.json as published (transformers 4.x style rope keys under text_config)."""
    config = ModelConfig.from_hf({
        "model_type": "qwen3_5", "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "full_attention_interval": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                        "rope_scaling": {"rope_type": "default", "mrope_section": [11, 11, 10],
                                         "mrope_interleaved": True},
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25, "mtp_num_hidden_layers": 1,
                        "tie_word_embeddings": False, "eos_token_id": 7}})
    assert config.model_type == "qwen3_5" and config.tie_word_embeddings
    assert config.layer_mix()["pattern"] == "LLLFLLLF" and config.num_kv_layers == 2
    assert config.partial_rotary_factor == 0.25 and config.rope_scaling is None and config.rope_theta == 1e7
    assert config.linear.conv_dim == 2 * 2 * 16 + 4 * 16 and config.moe is None
    assert config.mtp.layout == "qwen3_next" and config.mtp.zero_centered_norms and config.eos_token_ids == (7,)
