"""``mtplx.config``: file round trip, precedence (flag > environment > file > default), and
errors that name the key, the value, the source and what is allowed."""

from __future__ import annotations

import pytest

from mtplx.batching.state import SchedulerConfigError, SchedulerMode
from mtplx.cli import main
from mtplx.config import Config, ConfigError, set_value, unset_value


@pytest.fixture
def cfg_file(tmp_path, monkeypatch):
    path = tmp_path / "mtplx" / "config.toml"
    monkeypatch.setenv("MTPLX_CONFIG", str(path))
    for name in ("SCHEDULER_MODE", "PORT", "HOST", "DEPTH", "BATCH_WAIT_MS", "API_KEY"):
        monkeypatch.delenv(f"MTPLX_{name}", raising=False)
    return path


def test_defaults_without_a_file(cfg_file):
    cfg = Config.load()
    assert cfg.scheduler_mode == SchedulerMode.SERIAL and cfg.host == "127.0.0.1" and cfg.port == 8000
    assert cfg.max_active_requests is None and cfg.decode_batch_max is None and cfg.batch_wait_ms is None
    assert all(cfg.source(k) == "default" for k in cfg.as_dict())


def test_set_then_load_round_trips_every_kind_of_value(cfg_file):
    values = {"model": "/models/my model.gguf", "scheduler_mode": "mtp_batch", "generation_mode": "mtp",
              "depth": "3", "host": "::1", "port": "9001", "decode_batch_max": "4", "batch_wait_ms": "12.5",
              "max_queued_requests": "7", "dtype": "bfloat16"}
    for key, text in values.items():
        set_value(key, text)
    cfg = Config.load()
    assert cfg.model == "/models/my model.gguf" and cfg.scheduler_mode is SchedulerMode.MTP_BATCH
    assert (cfg.depth, cfg.port, cfg.decode_batch_max, cfg.batch_wait_ms, cfg.max_queued_requests) == (3, 9001, 4, 12.5, 7)
    assert cfg.host == "::1" and cfg.generation_mode == "mtp" and cfg.dtype == "bfloat16"
    assert cfg.source("port") == f"config file {cfg_file}"
    set_value("depth", "auto")  # adaptive depth: a value, not the default
    assert Config.load().depth == "auto"
    assert unset_value("depth") and unset_value("port")
    assert not unset_value("port")  # not there any more: nothing to remove (it said "removed" again)
    cfg = Config.load()
    assert cfg.depth is None and cfg.port == 8000 and cfg.scheduler_mode is SchedulerMode.MTP_BATCH


def test_set_auto_removes_every_key_but_depth(cfg_file):
    """'auto' (or '') is each key's default: set never writes it as a value (an api_key of "auto"
    would be a key clients could send), whatever the key's kind."""
    from mtplx.config import KEYS, read_file

    for key, text in {"model": "/m.gguf", "host": "::1", "api_key": "s3cret", "port": "9001",
                      "tensor_parallel": "2", "max_queued_requests": "7", "max_depth": "2"}.items():
        set_value(key, text)
    for key in ("model", "host", "api_key", "port", "tensor_parallel", "max_queued_requests", "max_depth"):
        set_value(key, "auto")
    assert read_file(cfg_file) == {}
    cfg = Config.load()
    assert cfg.api_key is None and cfg.host == "127.0.0.1" and cfg.port == 8000 and cfg.model is None


def test_flag_beats_environment_beats_file(cfg_file, monkeypatch):
    set_value("port", "9000")
    set_value("scheduler_mode", "ar_batch")
    monkeypatch.setenv("MTPLX_PORT", "9100")
    cfg = Config.load(overrides={"port": "9200", "scheduler_mode": None})
    assert cfg.port == 9200 and cfg.source("port") == "flag --port"
    assert cfg.scheduler_mode is SchedulerMode.AR_BATCH  # a flag not given (None) does not override
    assert Config.load().port == 9100 and Config.load().source("port") == "environment MTPLX_PORT"


def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(cfg_file, monkeypatch):
    with pytest.raises(ConfigError) as err:
        set_value("port", "70000")
    assert "port = '70000'" in str(err.value) and "from 1 to 65535" in str(err.value)
    monkeypatch.setenv("MTPLX_SCHEDULER_MODE", "turbo")
    with pytest.raises(ConfigError) as err:
        Config.load()
    message = str(err.value)
    assert "'turbo'" in message and "MTPLX_SCHEDULER_MODE" in message
    assert all(mode in message for mode in SchedulerMode.choices())


def test_an_invalid_scheduler_mode_lists_the_choices():
    with pytest.raises(SchedulerConfigError, match="serial, mtp_batch, hyper, ar_batch, solo_mtp"):
        SchedulerMode.parse("fast")
    assert SchedulerMode.choices() == ["serial", "mtp_batch", "hyper", "ar_batch", "solo_mtp"]
    assert SchedulerMode("hyper") == "hyper"  # a str enum


def test_a_malformed_file_names_the_file_and_the_line(cfg_file):
    cfg_file.parent.mkdir(parents=True)
    cfg_file.write_text('port = 8000\nscheduler_mode = "serial\n')
    with pytest.raises(ConfigError, match=rf"{cfg_file}, line 2: invalid TOML"):
        Config.load()
    cfg_file.write_text('port = 8000\n\ndepth = 11\n')
    with pytest.raises(ConfigError, match=rf"depth = 11 \(config file {cfg_file}, line 3\).*from 1 to 8"):
        Config.load()
    cfg_file.write_text('colour = "blue"\n')
    with pytest.raises(ConfigError, match=r"line 1: unknown key 'colour'; known keys: model, scheduler_mode"):
        Config.load()


def test_the_api_key_is_never_shown(cfg_file, capsys):
    assert main(["config", "set", "api_key", "s3cret"]) == 0
    assert main(["config", "show"]) == 0
    assert main(["config", "get", "api_key"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "***" in out
    assert Config.load().api_key == "s3cret"
    assert oct(cfg_file.stat().st_mode & 0o777) == "0o600"


def test_an_unset_depth_is_not_shown_as_the_value_auto(cfg_file, capsys):
    """depth = "auto" is adaptive depth; an unset depth is the engine's choice (depth 1, or
    tune's verdict): config showed both as "auto"."""
    assert main(["config", "get", "depth"]) == 0
    assert capsys.readouterr().out.strip() == "engine default"
    assert main(["config", "set", "depth", "auto"]) == 0 and main(["config", "get", "depth"]) == 0
    assert capsys.readouterr().out.strip().endswith("auto")


def test_config_command_round_trip(cfg_file, capsys):
    assert main(["config", "set", "scheduler_mode", "hyper"]) == 0
    assert main(["config", "set", "batch_wait_ms", "0"]) == 0
    capsys.readouterr()
    assert main(["config", "get", "scheduler_mode"]) == 0
    assert capsys.readouterr().out.strip() == "hyper"
    assert main(["config", "show"]) == 0
    shown = capsys.readouterr().out
    assert "scheduler_mode" in shown and f"config file {cfg_file}" in shown
    assert main(["config", "set", "scheduler_mode", "warp"]) == 2
    assert "must be one of serial, mtp_batch, hyper, ar_batch, solo_mtp" in capsys.readouterr().err
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cfg_file)


def test_a_file_with_bad_entries_is_mended_a_key_at_a_time(cfg_file, capsys):
    """set and unset keep the file's other entries as they are (bad or unknown ones too), and
    unset removes an unknown key the file holds: the CLI can repair what Config.load refuses."""
    cfg_file.parent.mkdir(parents=True)
    cfg_file.write_text('colour = "blue"\nport = 99999\nshiny = true\nsince = 2026-12-07\n[server]\nport = 1\n')
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err  # every wrong entry at once, each with its line
    assert "5 problems" in err and all(f"line {n}" in err for n in (1, 2, 3, 4, 5)), err
    assert main(["config", "set", "port", "8001"]) == 2  # the table cannot be written back...
    assert "`mtplx config unset server` removes it" in capsys.readouterr().err
    assert main(["config", "unset", "server"]) == 0  # ...until it is removed
    assert main(["config", "set", "port", "8001"]) == 0
    assert main(["config", "show"]) == 2  # colour is still there...
    for key in ("colour", "shiny"):
        assert main(["config", "unset", key]) == 0
    assert 'since = 2026-12-07' in cfg_file.read_text()
    assert main(["config", "unset", "since"]) == 0
    assert Config.load().port == 8001 and cfg_file.read_text().count("=") == 1  # ...until unset
    capsys.readouterr()
    assert main(["config", "unset", "colour"]) == 2  # not in the file, and not a key
    assert "unknown key 'colour'" in capsys.readouterr().err


def test_set_warns_where_serve_would_refuse_the_settings(cfg_file, capsys):
    assert main(["config", "set", "scheduler_mode", "hyper"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["config", "set", "max_active_requests", "4"]) == 0  # saved: a flag may still mend it
    assert "`mtplx serve` would refuse these settings: hyper admits one request" in capsys.readouterr().err
    assert Config.load().max_active_requests == 4
    assert main(["config", "unset", "scheduler_mode"]) == 0  # serial takes no concurrency knob either
    assert "would refuse these settings" in capsys.readouterr().err
    assert main(["config", "unset", "max_active_requests"]) == 0
    assert "warning" not in capsys.readouterr().err
