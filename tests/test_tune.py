"""Tune: the fastest depth is saved when it beats AR, else AR as the default mode; collapsed
depths never win; load, generate and serve read it back."""

import argparse
import json

import pytest
import torch

from mtplx import tuning
from mtplx.commands import tune as tune_command
from tests.tiny_models import tiny_engine


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own ~ so ~/.mtplx/tuning.json is private to it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def _report(ar: float, by_depth: dict[int, tuple[float, float]]) -> dict:
    """A benchmarking.measure-shaped report: depth -> (tok/s, acceptance rate)."""
    configs = {"ar": {"mode": "ar", "depth": 0, "tok_s": ar}}
    for depth, (tok_s, acc) in by_depth.items():
        configs[f"mtp_d{depth}"] = {"mode": "mtp", "depth": depth, "tok_s": tok_s, "acceptance_rate": acc,
                                    "acceptance_by_depth": [acc] * depth}
    return {"configs": configs, "machine": {"device": "cpu"}}


def test_pick_depth_keeps_ar_when_no_depth_beats_it():
    choice = tuning.pick_depth(_report(40.0, {1: (39.0, 0.7), 2: (35.0, 0.6), 3: (30.0, 0.5)}))
    assert choice["depth"] is None
    assert choice["message"].startswith("no MTP depth beat AR")


def test_pick_depth_names_the_fastest_depth_with_the_speedup():
    choice = tuning.pick_depth(_report(41.0, {1: (55.0, 0.7), 2: (63.2, 0.6), 3: (60.0, 0.5)}))
    assert choice["depth"] == 2
    assert choice["message"] == "depth 2 is fastest: 41.0 -> 63.2 tok/s, 1.54x"


def test_pick_depth_never_picks_a_collapsed_depth():
    choice = tuning.pick_depth(_report(40.0, {1: (50.0, 0.01), 2: (45.0, 0.3)}))
    assert choice["depth"] == 2 and choice["collapsed"] == [1]
    assert tuning.pick_depth(_report(40.0, {1: (90.0, 0.04)}))["depth"] is None


def test_saved_depth_is_read_back_for_the_same_model_device_and_dtype():
    engine, _ = tiny_engine("llama")
    loaded = engine.loaded
    report = _report(40.0, {1: (50.0, 0.7), 3: (60.0, 0.5)})
    path = tuning.save_choice(loaded, engine.device, engine.dtype, tuning.pick_depth(report), report)
    assert path == tuning.tuning_path() and path.is_file()
    assert tuning.tuned_depth(loaded, engine.device, engine.dtype) == 3
    assert tuning.tuned_depth(loaded, engine.device, torch.bfloat16) is None  # another dtype: not tuned


def test_no_winner_replaces_an_earlier_depth_with_ar():
    engine, _ = tiny_engine("llama")
    args = (engine.loaded, engine.device, engine.dtype)
    win = _report(40.0, {2: (60.0, 0.6)})
    tuning.save_choice(*args, tuning.pick_depth(win), win)
    assert tuning.tuned(*args) == {"depth": 2}
    lose = _report(40.0, {2: (30.0, 0.6)})
    tuning.save_choice(*args, tuning.pick_depth(lose), lose)
    assert tuning.tuned(*args) == {"mode": "ar"} and tuning.tuned_depth(*args) is None
    [entry] = json.loads(tuning.tuning_path().read_text())["entries"].values()
    assert entry["ar_tok_s"] == 40.0 and entry["best_mtp_tok_s"] == 30.0


def test_tune_saves_ar_when_no_depth_beats_it(monkeypatch, capsys):
    engine, _ = tiny_engine("llama")  # a random head: its drafts are almost never accepted
    monkeypatch.setattr(tune_command, "load_engine", lambda args: engine)
    args = argparse.Namespace(depths="1,2", max_tokens=12, repeats=1)
    assert tune_command.run(args) == 0
    out = capsys.readouterr().out
    assert "no MTP depth beat AR" in out and "default to AR" in out
    assert tuning.tuned(engine.loaded, engine.device, engine.dtype) == {"mode": "ar"}


def test_an_engine_defaulting_to_ar_still_serves_mtp_on_request():
    engine, _ = tiny_engine("llama")
    ar_engine = type(engine)(engine.loaded, default_mode="ar", kv_cache_tokens=512, block_size=4)
    assert ar_engine.make_request([3, 4, 5]).mode == "ar"
    assert ar_engine.make_request([3, 4, 5], mode="mtp").mode == "mtp"
    assert engine.make_request([3, 4, 5]).mode == "mtp"  # the default with a head
    with pytest.raises(Exception, match="default_mode"):
        type(engine)(engine.loaded, default_mode="fast")


def test_tune_without_a_head_has_nothing_to_do(monkeypatch):
    engine, _ = tiny_engine("llama", head=False)
    monkeypatch.setattr(tune_command, "load_engine", lambda args: engine)
    assert tune_command.run(argparse.Namespace(depths="1", max_tokens=8, repeats=1)) == 0
    assert not tuning.tuning_path().exists()
