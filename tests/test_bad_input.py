"""Every mistake a user can make gets a clear error naming what was wrong and what is allowed;
the CLI prints it on one line and exits non-zero, without a traceback."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import save_file

import mtplx
from mtplx.errors import InvalidParameter, ModelLoadError, UnsupportedModel
from tests.tiny_models import hf_reference, tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")[0]


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=10_000), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=5.0), "presence_penalty"),
    (dict(mode="mtp", depth=0), "depth"),
    (dict(mode="mtp", depth=99), "depth"),
    (dict(mode="fast"), "mode"),
    (dict(draft_policy="typical"), "draft_policy"),
    (dict(stop=[""]), "stop"),
    (dict(ignore_eos="false"), "ignore_eos"),  # a string would be true
    (dict(chat=1), "chat"),
])
def test_bad_generation_parameters_name_the_parameter(engine, kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        engine.generate([1, 2, 3], **kwargs)
    assert err.value.param == param
    assert param in str(err.value)
    with pytest.raises(InvalidParameter):  # at the call, before any piece is asked for
        engine.stream([1, 2, 3], **kwargs)


def test_prompt_longer_than_the_context_is_refused(engine):
    with pytest.raises(InvalidParameter, match="context is 256 tokens"):
        engine.generate(list(range(2, 90)) * 3)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(InvalidParameter, match="outside"):
        engine.generate([1, 2, 500])


def test_mtp_on_a_model_without_a_head_says_why():
    engine, _ = tiny_engine("llama", head=False)
    with pytest.raises(InvalidParameter, match="no MTP head"):
        engine.generate([1, 2], mode="mtp")
    assert engine.generate([1, 2], max_tokens=2).stats["mode"] == "ar"  # the default runs AR


def test_unknown_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        mtplx.load("/no/such/model", device="cpu")


def _write(tmp_path, cfg, state):
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    hf, cfg = hf_reference("llama")
    _write(tmp_path, {**cfg, "model_type": "gpt2"}, hf.state_dict())
    with pytest.raises(UnsupportedModel) as err:
        mtplx.load(tmp_path, device="cpu")
    assert "'gpt2'" in str(err.value) and "llama" in str(err.value) and "qwen3" in str(err.value)


def test_tensor_shape_mismatch_names_tensor_and_shapes(tmp_path):
    hf, cfg = hf_reference("llama")
    state = dict(hf.state_dict())
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:100]
    _write(tmp_path, cfg, state)
    with pytest.raises(ModelLoadError) as err:
        mtplx.load(tmp_path, device="cpu")
    msg = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "(100, 64)" in msg and "(128, 64)" in msg


def test_missing_tensor_is_named(tmp_path):
    hf, cfg = hf_reference("llama")
    state = dict(hf.state_dict())
    del state["model.norm.weight"]
    _write(tmp_path, cfg, state)
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        mtplx.load(tmp_path, device="cpu")


def test_bad_device_and_dtype():
    with pytest.raises(InvalidParameter, match="dtype"):
        mtplx.load("/tmp", device="cpu", dtype="int8")
    with pytest.raises(InvalidParameter, match="device"):
        mtplx.load("/tmp", device="tpu")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mtplx.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_prints_one_line_errors_without_traceback(tmp_path):
    hf, cfg = hf_reference("llama")
    _write(tmp_path, cfg, hf.state_dict())
    for args, needle in [
        (["generate", "hi", "--model", "/no/such/dir"], "does not exist"),
        (["generate", "hi", "--model", str(tmp_path)], "token-id prompts"),
        (["generate", "hi", "--model", str(tmp_path), "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--model", str(tmp_path), "--mode", "mtp"], "no MTP head"),
    ]:
        proc = _cli(*args)
        assert proc.returncode != 0
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_bench_and_tune_refuse_bad_options_before_loading_and_depth_limits_agree():
    from mtplx.commands import common
    from mtplx.engine.llm_engine import MAX_DEPTH

    assert common.MAX_DEPTH == MAX_DEPTH
    for args, needle in [
        (["bench", "--model", "/no/such/dir", "--depths", "0"], "depths"),
        (["tune", "--model", "/no/such/dir", "--depths", ""], "depths"),
        (["bench", "--model", "/no/such/dir", "--depths", "1,9"], "depths"),
        (["bench", "--model", "/no/such/dir", "--depths", "1,,"], "depths"),  # (an empty entry is no depth)
        (["bench", "--model", "/no/such/dir", "--repeats", "0"], "repeats"),
        (["tune", "--model", "/no/such/dir", "--max-tokens", "0"], "max-tokens"),
        (["bench", "--model", "/no/such/dir", "--json", "/no/such/dir/report.json"], "no such folder"),
        (["generate", "hi", "--model", "/no/such/dir", "--max-tokens", "0"], "max-tokens"),
        (["generate", "hi", "--model", "/no/such/dir", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--model", "/no/such/dir", "--max-depth", "9"], "max_depth"),
        (["serve", "--model", "/no/such/dir", "--api-key", ""], "api-key: is empty"),  # not "no key"
        (["serve", "--model", "/no/such/dir", "--served-model-name", " "], "served-model-name: is empty"),
        (["serve", "--model", "/no/such/dir", "--allowed-origin", "localhost:3000"], "is not an origin"),
    ]:
        proc = _cli(*args)  # the model path does not exist: these fail on the option, before any load
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_the_cli_parses_and_refuses_options_without_importing_pytorch():
    """``mtplx --help`` and a bad bench or tune option answer at once: PyTorch (about 2 s to
    import on this machine) comes only with a command's work."""
    code = ("import sys; from mtplx.cli import build_parser, main; build_parser(); "
            "code = main(['bench', '--model', '/no/such/dir', '--depths', '0']); "
            "main(['tune', '--model', '/no/such/dir', '--repeats', '0']) if code == 2 else None; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


@pytest.mark.parametrize("option", [{"max_depth": 0}, {"kv_cache_tokens": 0}, {"kv_cache_tokens": -5},
                                    {"kv_cache_tokens": "a"}, {"block_size": 0}, {"block_size": 2.5},
                                    {"depth": 9}, {"depth": "deep"}, {"max_depth": 9}])
def test_load_refuses_sizes_below_one_by_name_before_loading(option):
    with pytest.raises(InvalidParameter) as err:
        mtplx.load("/no/such/model", **option)  # the path is never read: the option fails first
    assert err.value.param == next(iter(option))


@pytest.mark.slow
def test_generate_into_a_closed_pipe_ends_quietly(default_gguf):
    """`mtplx generate ... | head -c 0`: the reader is gone before the first piece; the command
    stops without a traceback and exits 141 (as a process killed by SIGPIPE reads in a shell)."""
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "generate", "Tell me a story", "--max-tokens", "8",
                             "--model", str(default_gguf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and "Traceback" not in err and "Error" not in err, err


def test_the_model_commands_read_the_config_file_under_their_flags(tmp_path, monkeypatch):
    """generate, bench, tune and inspect load the model the config file names (as serve does),
    and a flag beats it."""
    hf, cfg = hf_reference("llama")
    _write(tmp_path, cfg, hf.state_dict())
    config = tmp_path / "config.toml"
    config.write_text('model = "/no/such/configured/model"\n')
    monkeypatch.setenv("MTPLX_CONFIG", str(config))
    for args in (["generate", "hi"], ["bench"], ["tune"], ["inspect"]):
        proc = _cli(*args)
        assert proc.returncode == 2 and "/no/such/configured/model" in proc.stderr, (args, proc.stderr)
    assert _cli("inspect", str(tmp_path)).returncode == 4  # the positional MODEL beats the file
    config.write_text('port = 99999\nscheduler_mode = "warp"\n')  # serve's keys are serve's to check
    assert _cli("inspect", str(tmp_path)).returncode == 4
    config.write_text('max_depth = 12\n')
    proc = _cli("generate", "hi", "--model", str(tmp_path))
    assert proc.returncode == 2 and "max_depth = 12" in proc.stderr and str(config) in proc.stderr


@pytest.mark.slow
def test_generate_reads_the_prompt_from_stdin_and_inspect_refuses_a_truncated_gguf(default_gguf, tmp_path):
    args = [sys.executable, "-m", "mtplx.cli", "generate", "--model", str(default_gguf), "--max-tokens", "6",
            "--json"]
    runs = [subprocess.Popen([*args, prompt], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for prompt in ("-", "Name a color.")]  # side by side: two cores
    (piped_out, piped_err), (given_out, _) = [p.communicate(text, timeout=300) for p, text in
                                              zip(runs, ("Name a color.", ""))]
    piped = subprocess.CompletedProcess(args, runs[0].returncode, piped_out, piped_err)
    given = subprocess.CompletedProcess(args, runs[1].returncode, given_out, "")
    assert piped.returncode == 0 and json.loads(piped.stdout)["token_ids"] == json.loads(given.stdout)["token_ids"]
    assert json.loads(piped.stdout)["prompt_tokens"] == json.loads(given.stdout)["prompt_tokens"]
    cut = tmp_path / "cut.gguf"
    data = default_gguf.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])  # the header whole, the last tensor's bytes short
    proc = _cli("inspect", str(cut))
    assert proc.returncode == 2 and "truncated" in proc.stderr, proc.stderr


def test_cli_inspect_exit_codes_differ_per_tier(tmp_path):
    hf, cfg = hf_reference("llama")
    _write(tmp_path, cfg, hf.state_dict())
    assert _cli("inspect", str(tmp_path)).returncode == 4  # AR-only
    missing = _cli("inspect", str(tmp_path), "--head", str(tmp_path / "nowhere"))  # as mtplx.load: an error
    assert missing.returncode == 2 and "no mtp.safetensors in" in missing.stderr
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}, default=str))
    unsupported = _cli("inspect", str(tmp_path), "--json")
    assert unsupported.returncode == 5 and json.loads(unsupported.stdout)["tier"] == "unsupported"
    assert _cli("inspect", "/no/such/path").returncode == 2


def test_the_default_draft_policy_samples_drafts_from_the_mirror_temperature_up(engine):
    # draft_policy "auto" (the default) resolves per request; an explicit policy is kept
    from mtplx.engine.llm_engine import CPU_MIRROR_FROM_TEMPERATURE, MIRROR_FROM_TEMPERATURE, mirror_from
    assert engine.device.type == "cpu" and mirror_from("cpu") == CPU_MIRROR_FROM_TEMPERATURE
    assert mirror_from("cuda") == MIRROR_FROM_TEMPERATURE
    below = CPU_MIRROR_FROM_TEMPERATURE - 0.05
    for temperature, policy in ((0.0, "greedy"), (below, "greedy"), (CPU_MIRROR_FROM_TEMPERATURE, "mirror"),
                                (1.0, "mirror")):
        assert engine.make_request([1, 2, 3], temperature=temperature).draft_policy == policy
    assert engine.make_request([1, 2, 3], temperature=1.0, draft_policy="greedy").draft_policy == "greedy"
    assert engine.make_request([1, 2, 3], temperature=0.5, draft_policy="mirror").draft_policy == "mirror"


@pytest.mark.slow
def test_malformed_prompts_and_stops_are_invalid_parameters_naming_the_field(default_gguf):
    """Every shape a Python caller can get wrong is refused as InvalidParameter naming it (not a
    TypeError from the loop, a template engine's error, or the tokenizer's)."""
    engine = mtplx.load(default_gguf, head=None)
    for prompt, kwargs, param in [
        ("hi", {"stop": 5}, "stop"),
        ([], {"chat": True}, "prompt"),
        ([{"role": "user"}], {"chat": True}, "prompt"),
        ([{"role": "user", "content": None}], {"chat": True}, "prompt"),
        ([{"role": "user", "content": 7}], {"chat": True}, "prompt"),
        ("a\ud800b", {}, "prompt"),
        ([{"role": "user", "content": "a\ud800b"}], {"chat": True}, "prompt[0].content"),
    ]:
        with pytest.raises(InvalidParameter) as err:
            engine.generate(prompt, max_tokens=2, **kwargs)
        assert err.value.param == param, (prompt, kwargs)


@pytest.mark.parametrize("origin, ok", [
    ("http://localhost:3000", True), ("https://a.example", True), ("http://[::1]:3000", True),
    ("http://127.0.0.1:8080", True), ("http://*.example.com", False), ("https://example.com:443", False),
    ("http://user@a.example", False), ("http://localhost:99999", False), ("http://localhost:0", False),
    ("http://a.example/", False), ("localhost:3000", False), ("http://A.example", False), ("ftp://a.example", False)])
def test_allowed_origins_are_origins_as_a_browser_sends_them(origin, ok):
    """CORS compares the Origin header literally: an origin that no browser sends (a wildcard
    host, a default port, a user, a path, capitals) would never match, so serve refuses it."""
    from mtplx.commands.serve import is_origin

    assert is_origin(origin) is ok
