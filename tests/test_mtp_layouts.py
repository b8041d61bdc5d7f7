"""Native MTP weights load in all three checkpoint layouts, and forged sidecars are checked
against the trunk they were trained for."""

import json

import pytest
import torch
from safetensors.torch import save_file

import mtplx
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.sequence import Sequence
from mtplx.errors import InvalidParameter, ModelLoadError
from mtplx.loading.describe import describe
from tests.tiny_models import hf_reference

H = 64


def _head_tensors(g: torch.Generator, prefix_names: dict[str, str], layer_prefix: str) -> dict:
    """Random head weights under a layout's names; also returns them under canonical names."""
    canon = {
        "fc.weight": torch.randn(H, 2 * H) * 0.1,
        "pre_fc_norm_embedding.weight": 1 + 0.1 * torch.randn(H),
        "pre_fc_norm_hidden.weight": 1 + 0.1 * torch.randn(H),
        "norm.weight": 1 + 0.1 * torch.randn(H),
    }
    layer = {
        "input_layernorm.weight": 1 + 0.1 * torch.randn(H),
        "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H),
        "self_attn.q_proj.weight": torch.randn(64, H) * 0.1,
        "self_attn.k_proj.weight": torch.randn(32, H) * 0.1,
        "self_attn.v_proj.weight": torch.randn(32, H) * 0.1,
        "self_attn.o_proj.weight": torch.randn(H, 64) * 0.1,
        "mlp.gate_proj.weight": torch.randn(128, H) * 0.1,
        "mlp.up_proj.weight": torch.randn(128, H) * 0.1,
        "mlp.down_proj.weight": torch.randn(H, 128) * 0.1,
    }
    on_disk = {prefix_names[k]: v for k, v in canon.items()}
    on_disk.update({layer_prefix + k: v for k, v in layer.items()})
    canon.update({"layers.0." + k: v for k, v in layer.items()})
    return on_disk, canon


LAYOUTS = {
    "qwen3_next": ({"fc.weight": "mtp.fc.weight", "pre_fc_norm_embedding.weight": "mtp.pre_fc_norm_embedding.weight",
                    "pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight", "norm.weight": "mtp.norm.weight"},
                   "mtp.layers.0.", {"mtp_num_hidden_layers": 1}, "llama"),
    "deepseek": ({"fc.weight": "model.layers.2.eh_proj.weight", "pre_fc_norm_embedding.weight": "model.layers.2.enorm.weight",
                  "pre_fc_norm_hidden.weight": "model.layers.2.hnorm.weight",
                  "norm.weight": "model.layers.2.shared_head.norm.weight"},
                 "model.layers.2.", {"num_nextn_predict_layers": 1}, "llama"),
    "mimo": ({"fc.weight": "model.mtp_layers.0.input_proj.weight",
              "pre_fc_norm_embedding.weight": "model.mtp_layers.0.token_layernorm.weight",
              "pre_fc_norm_hidden.weight": "model.mtp_layers.0.hidden_layernorm.weight",
              "norm.weight": "model.mtp_layers.0.final_layernorm.weight"},
             "model.mtp_layers.0.", {"num_nextn_predict_layers": 1}, "qwen2"),
}


def write_checkpoint(tmp_path, layout: str):
    names, layer_prefix, cfg_extra, arch = LAYOUTS[layout]
    hf, cfg = hf_reference(arch)
    g = torch.Generator().manual_seed(7)
    on_disk, canon = _head_tensors(g, names, layer_prefix)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state.update(on_disk)
    if layout == "deepseek":  # DeepSeek repeats the shared tensors inside the MTP layer
        state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    cfg = {**cfg, **cfg_extra, "model_type": "mimo" if layout == "mimo" else cfg["model_type"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    save_file(state, str(tmp_path / "model.safetensors"))
    return hf, canon


def reference_head(hf, canon, hidden, tokens, hidden_first: bool):
    """The MTP formula computed with transformers' own decoder layer and norms."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    cfg = hf.config
    cfg._attn_implementation = "eager"
    def norm(w, x):
        n = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w)
        return n(x)
    if cfg.model_type == "qwen2":  # qwen2 has q/k/v bias: the head uses the trunk's attention type
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as layer_cls
    else:
        layer_cls = LlamaDecoderLayer
    layer = layer_cls(cfg, layer_idx=0)
    layer_state = {k[len("layers.0."):]: v for k, v in canon.items() if k.startswith("layers.0.")}
    missing = layer.load_state_dict(layer_state, strict=False).missing_keys
    for k in missing:  # biases of a qwen2 head: zero
        dict(layer.named_parameters())[k].data.zero_()
    e = norm(canon["pre_fc_norm_embedding.weight"], hf.model.embed_tokens(tokens))
    h = norm(canon["pre_fc_norm_hidden.weight"], hidden)
    x = torch.cat((h, e) if hidden_first else (e, h), dim=-1) @ canon["fc.weight"].T
    T = x.shape[1]
    pos = torch.arange(1, T + 1)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    return norm(canon["norm.weight"], out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_native_mtp_layout_loads_and_matches_reference_formula(tmp_path, layout):
    hf, canon = write_checkpoint(tmp_path, layout)
    if layout == "mimo":  # qwen2 head layers carry q/k/v biases the test did not write
        with pytest.raises(ModelLoadError, match="bias"):
            mtplx.load(tmp_path, device="cpu")
        from safetensors.torch import load_file
        full = load_file(str(tmp_path / "model.safetensors"))
        for p in ("q", "k", "v"):
            full[f"model.mtp_layers.0.self_attn.{p}_proj.bias"] = torch.zeros(64 if p == "q" else 32)
        save_file(full, str(tmp_path / "model.safetensors"))
    engine = mtplx.load(tmp_path, device="cpu", kv_dtype="float32")  # the formula to 1e-4: exact entries
    assert engine.has_mtp and engine.loaded.head_info["layout"] == layout
    assert describe(tmp_path)["tier"] == "verified"

    runner = engine.runner
    g = torch.Generator().manual_seed(3)
    T = 6
    hidden = torch.randn(1, T, H)
    tokens = torch.randint(0, 96, (1, T))
    seq = Sequence(prompt_ids=[0] * (T + 1), params=SamplingParams(), max_tokens=1)
    runner.blocks.allocate(seq.seq_id, seq.prompt_ids)
    ours = runner.head_forward([seq], hidden, [tokens[0].tolist()], [1])
    with torch.no_grad():
        ref = reference_head(hf, canon, hidden, tokens, hidden_first=layout == "mimo")
    assert (ours - ref).abs().max() <= 1e-4

    ar = engine.generate([1, 2, 3], mode="ar", max_tokens=12)
    for depth in (1, 3):
        assert engine.generate([1, 2, 3], mode="mtp", depth=depth, max_tokens=12).token_ids == ar.token_ids


def test_directory_without_tokenizer_loads_and_text_prompt_is_refused(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next")
    engine = mtplx.load(tmp_path, device="cpu")
    assert engine.tokenizer is None
    assert len(engine.generate([4, 5, 6], max_tokens=3).token_ids) == 3
    with pytest.raises(InvalidParameter, match="token-id prompts"):
        engine.generate("hello")


def _write_sidecar(tmp_path, trunk_hash):
    from tests.tiny_models import random_head

    engine = mtplx.load(tmp_path, device="cpu")
    head = random_head(engine.loaded.model)
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    save_file({"mtp." + k: v.contiguous() for k, v in head.state_dict().items()}, str(head_dir / "mtp.safetensors"))
    (head_dir / "mtplx_forge.json").write_text(json.dumps({"trunk_sha256": trunk_hash}))
    return head_dir


def _plain_trunk(tmp_path):
    hf, cfg = hf_reference("llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))


def test_sidecar_head_for_this_trunk_loads_verified(tmp_path):
    from mtplx.loading.hf_dir import sha256_of_weights

    _plain_trunk(tmp_path)
    head_dir = _write_sidecar(tmp_path, sha256_of_weights(tmp_path))
    engine = mtplx.load(tmp_path, device="cpu", head=head_dir)
    assert engine.has_mtp and engine.loaded.head_info["verified"] is True
    assert describe(tmp_path, head_dir)["tier"] == "verified"
    ar = engine.generate([7, 8, 9], mode="ar", max_tokens=10)
    assert engine.generate([7, 8, 9], mode="mtp", depth=2, max_tokens=10).token_ids == ar.token_ids


def test_sidecar_head_for_another_trunk_is_refused_unless_overridden(tmp_path):
    from mtplx.loading.hf_dir import sha256_of_weights

    _plain_trunk(tmp_path)
    head_dir = _write_sidecar(tmp_path, "0" * 64)
    actual = sha256_of_weights(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        mtplx.load(tmp_path, device="cpu", head=head_dir)
    assert "0" * 64 in str(err.value) and actual in str(err.value)
    engine = mtplx.load(tmp_path, device="cpu", head=head_dir, allow_unverified_head=True)
    assert engine.has_mtp and engine.loaded.head_info["verified"] is False
    assert describe(tmp_path, head_dir)["tier"] == "unverified"
