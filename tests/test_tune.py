"""Tune: the fastest depth is saved when it beats AR, else AR as the default mode; collapsed
depths never win; greedy and sampled decoding are tuned apart; load, generate and serve read
it back."""

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

import mtplx
from mtplx import tuning
from mtplx.commands import tune as tune_command
from mtplx.errors import InvalidParameter
from tests.tiny_models import hf_reference, ours_from_hf, random_head, tiny_engine


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


def test_tune_saves_ar_when_no_depth_beats_it_greedy_and_sampled(monkeypatch, capsys):
    engine, _ = tiny_engine("llama")  # a random head: its drafts are almost never accepted
    monkeypatch.setattr(tune_command, "load_engine", lambda args: engine)
    args = argparse.Namespace(depths="1,2", max_tokens=12, repeats=1, no_auto=False)
    assert tune_command.run(args) == 0
    out = capsys.readouterr().out
    assert "greedy: no MTP depth beat AR" in out and "sampled: no MTP depth beat AR" in out
    assert "greedy requests default to AR, sampled requests (temperature > 0) default to AR" in out
    tuned = tuning.tuned(engine.loaded, engine.device, engine.dtype, kv_dtype=engine.runner.cache.kv_dtype)
    costs = tuned.pop("depth_costs"), tuned["sampled"].pop("depth_costs")  # measured, for depth="auto"
    assert tuned == {"mode": "ar", "sampled": {"mode": "ar"}}
    assert all(len(c.cycles) == 2 and c.of(1) > 0 for c in costs)
    [entry] = json.loads(tuning.tuning_path().read_text())["entries"].values()
    assert entry["sampled"]["sampling"] == tuning.SAMPLED
    assert {"tok_s", "ar_tok_s", "best_mtp_tok_s"} <= entry.keys() & entry["sampled"].keys()


def test_an_engine_defaulting_to_ar_still_serves_mtp_on_request():
    engine, _ = tiny_engine("llama")
    ar_engine = type(engine)(engine.loaded, default_mode="ar", kv_cache_tokens=512, block_size=4)
    assert ar_engine.make_request([3, 4, 5]).mode == "ar"
    assert "default for greedy requests is AR" in ar_engine.make_request([3, 4, 5]).mtp_disabled_reason
    assert ar_engine.make_request([3, 4, 5], mode="mtp").mode == "mtp"
    assert ar_engine.make_request([3, 4, 5], mode="mtp").mtp_disabled_reason is None
    assert engine.make_request([3, 4, 5]).mode == "mtp"  # the default with a head
    with pytest.raises(Exception, match="default_mode"):
        type(engine)(engine.loaded, default_mode="fast")


def test_the_sampled_verdict_is_saved_beside_the_greedy_one_and_read_back():
    engine, _ = tiny_engine("llama")
    args = (engine.loaded, engine.device, engine.dtype)
    greedy = _report(40.0, {1: (50.0, 0.7), 3: (60.0, 0.5)})
    sampled = {**_report(40.0, {1: (30.0, 0.4), 3: (35.0, 0.2)}), "sampling": dict(tuning.SAMPLED)}
    tuning.save_choice(*args, tuning.pick_depth(greedy), greedy, sampled=(tuning.pick_depth(sampled), sampled))
    assert tuning.tuned(*args) == {"depth": 3, "sampled": {"mode": "ar"}}
    assert tuning.tuned_depth(*args) == 3
    [entry] = json.loads(tuning.tuning_path().read_text())["entries"].values()
    assert entry["sampled"] == {"mode": "ar", "tok_s": 40.0, "ar_tok_s": 40.0, "best_mtp_tok_s": 35.0,
                                "sampling": {"temperature": 0.7, "top_p": 0.95, "seed": 1234}}
    sampled = {**_report(40.0, {2: (48.0, 0.5)}), "sampling": dict(tuning.SAMPLED)}
    tuning.save_choice(*args, tuning.pick_depth(greedy), greedy, sampled=(tuning.pick_depth(sampled), sampled))
    assert tuning.tuned(*args) == {"depth": 3, "sampled": {"depth": 2}}
    [entry] = json.loads(tuning.tuning_path().read_text())["entries"].values()
    assert entry["sampled"]["speedup"] == 1.2 and entry["sampled"]["acceptance_by_depth"] == [0.5, 0.5]


def _write_entry(engine, entry: dict) -> None:
    """A tuning file holding ``entry`` for ``engine``'s model, as written by hand or an older mtplx."""
    key = tuning.model_key(engine.loaded, engine.device, engine.dtype)
    path = tuning.tuning_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "entries": {key: entry}}))


def test_an_entry_from_before_sampled_tuning_means_what_it_meant():
    engine, _ = tiny_engine("llama")
    args = (engine.loaded, engine.device, engine.dtype)
    _write_entry(engine, {"depth": 2, "tok_s": 60.0, "ar_tok_s": 40.0, "speedup": 1.5,
                          "acceptance_by_depth": [0.6, 0.4], "measured_at": "2026-11-30 10:00:00", "machine": {}})
    assert tuning.tuned(*args) == {"depth": 2}
    _write_entry(engine, {"mode": "ar", "tok_s": 40.0, "ar_tok_s": 40.0, "best_mtp_tok_s": 30.0})
    assert tuning.tuned(*args) == {"mode": "ar"}


@pytest.mark.parametrize("sampled", [{"depth": 0}, {"depth": 9}, {"depth": True}, {"depth": "2"}, {"mode": "fast"},
                                     [2], "ar", None])
def test_a_malformed_sampled_verdict_is_ignored(sampled):
    engine, _ = tiny_engine("llama")
    _write_entry(engine, {"depth": 2, "sampled": sampled})
    assert tuning.tuned(engine.loaded, engine.device, engine.dtype) == {"depth": 2}


def test_a_sampled_request_that_names_no_mode_takes_the_sampled_default():
    engine, _ = tiny_engine("llama")
    tuned = type(engine)(engine.loaded, sampled_mode="ar", kv_cache_tokens=512, block_size=4)
    assert tuned.make_request([3, 4, 5], temperature=0.7).mode == "ar"
    assert tuned.make_request([3, 4, 5]).mode == "mtp"  # greedy: unchanged
    assert tuned.make_request([3, 4, 5], temperature=0.7, mode="mtp").mode == "mtp"  # asked for
    # the other way round: AR for greedy requests, MTP for sampled ones
    split = type(engine)(engine.loaded, default_mode="ar", sampled_mode="mtp", kv_cache_tokens=512, block_size=4)
    assert split.make_request([3, 4, 5]).mode == "ar"
    assert split.make_request([3, 4, 5], temperature=0.7).mode == "mtp"
    assert split.make_request([3, 4, 5], temperature=0.7, mode="ar").mode == "ar"


def test_the_sampled_depth_applies_to_sampled_requests_that_name_no_depth():
    engine, _ = tiny_engine("llama")
    tuned = type(engine)(engine.loaded, depth=2, sampled_depth=3, kv_cache_tokens=512, block_size=4)
    assert tuned.make_request([3, 4, 5]).depth == 2
    assert tuned.make_request([3, 4, 5], temperature=0.7).depth == 3
    assert tuned.make_request([3, 4, 5], temperature=0.7, depth=1).depth == 1
    assert tuned.make_request([3, 4, 5], mode="ar", temperature=0.7).depth == 0
    assert engine.make_request([3, 4, 5], temperature=0.7).depth == engine.default_depth  # none given: as greedy


@pytest.mark.parametrize("kwargs, param", [(dict(sampled_mode="fast"), "sampled_mode"),
                                           (dict(sampled_depth=0), "sampled_depth"),
                                           (dict(sampled_depth=2.0), "sampled_depth")])
def test_a_bad_sampled_default_is_refused_by_name(kwargs, param):
    engine, _ = tiny_engine("llama")
    with pytest.raises(InvalidParameter) as err:
        type(engine)(engine.loaded, **kwargs)
    assert err.value.param == param


def _checkpoint_with_head(folder):
    """A tiny trunk on disk and a random sidecar head (no forge record: it loads unverified)."""
    hf, cfg = hf_reference("llama")
    (folder / "config.json").write_text(json.dumps(cfg, default=str))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(folder / "model.safetensors"))
    head_dir = folder / "head"
    head_dir.mkdir()
    head = random_head(ours_from_hf(hf, cfg))
    save_file({"mtp." + k: v.contiguous() for k, v in head.state_dict().items()}, str(head_dir / "mtp.safetensors"))
    return head_dir


def test_load_applies_both_verdicts(tmp_path):
    head_dir = _checkpoint_with_head(tmp_path)
    load = dict(device="cpu", head=head_dir, allow_unverified_head=True, kv_cache_tokens=512, block_size=4)
    engine = mtplx.load(tmp_path, **load)
    assert (engine.default_mode, engine.sampled_mode, engine.sampled_depth) == (None, None, None)  # not tuned
    greedy = _report(40.0, {2: (60.0, 0.6)})
    sampled = {**_report(40.0, {3: (48.0, 0.5)}), "sampling": dict(tuning.SAMPLED)}
    kv = engine.runner.cache.kv_dtype  # the CPU's float16 cache: part of the key
    tuning.save_choice(engine.loaded, engine.device, engine.dtype, tuning.pick_depth(greedy), greedy,
                       sampled=(tuning.pick_depth(sampled), sampled), kv_dtype=kv)
    assert mtplx.load(tmp_path, kv_dtype="float32", **load).make_request([3, 4, 5]).depth == 1  # not its verdict
    engine = mtplx.load(tmp_path, **load)
    assert engine.make_request([3, 4, 5]).depth == 2
    assert engine.make_request([3, 4, 5], temperature=0.7).depth == 3
    pinned = mtplx.load(tmp_path, depth=1, **load)  # an explicit depth is every request's
    assert pinned.make_request([3, 4, 5], temperature=0.7).depth == 1
    lose = {**_report(40.0, {3: (30.0, 0.5)}), "sampling": dict(tuning.SAMPLED)}
    tuning.save_choice(engine.loaded, engine.device, engine.dtype, tuning.pick_depth(greedy), greedy,
                       sampled=(tuning.pick_depth(lose), lose), kv_dtype=kv)
    engine = mtplx.load(tmp_path, **load)
    assert engine.make_request([3, 4, 5], temperature=0.7).mode == "ar"
    assert engine.make_request([3, 4, 5]).mode == "mtp" and engine.make_request([3, 4, 5]).depth == 2


def test_tune_without_a_head_has_nothing_to_do(monkeypatch):
    engine, _ = tiny_engine("llama", head=False)
    monkeypatch.setattr(tune_command, "load_engine", lambda args: engine)
    assert tune_command.run(argparse.Namespace(depths="1", max_tokens=8, repeats=1)) == 0
    assert not tuning.tuning_path().exists()


def test_an_auto_verdict_and_its_cycle_costs_are_saved_and_given_to_the_engine():
    """`mtplx tune` derives the cycle costs depth="auto" weighs from its side-by-side run (a
    depth-d cycle yields 1 + its acceptance by position tokens at its tok/s), and saves auto
    where auto beat the fixed depths; mtplx.load hands both to the engine."""
    engine, _ = tiny_engine("llama")
    args = (engine.loaded, engine.device, engine.dtype)
    fixed = _report(40.0, {1: (50.0, 0.5), 2: (48.0, 0.4)})
    costs = tuning.depth_costs(fixed)
    assert costs.cycles == pytest.approx((1.5 * 40 / 50, 1.8 * 40 / 48))
    second = _report(40.0, {1: (50.0, 0.5)})
    second["configs"]["mtp_auto"] = {"mode": "mtp", "depth": "auto", "tok_s": 55.0, "acceptance_rate": 0.5,
                                     "acceptance_by_depth": [0.5, 0.4]}
    choice = {**tuning.pick_depth(second), "depth_costs": costs}
    assert choice["depth"] == "auto"
    tuning.save_choice(*args, choice, second)
    tuned = tuning.tuned(*args)
    assert tuned["depth"] == "auto" and tuned["depth_costs"].cycles == pytest.approx(costs.cycles, abs=1e-4)
    engine = mtplx.Engine(engine.loaded, depth=tuned["depth"], depth_costs=tuned["depth_costs"])
    assert engine.make_request([3, 4, 5]).adaptive
    assert engine.auto_depth.costs.cycles == tuned["depth_costs"].cycles  # grown by width as the defaults


def test_a_verdict_measured_on_float_weights_is_not_the_quantized_models():
    """The same file loaded with quantized weights (the CPU default for a GGUF) decodes at other
    cycle costs: a depth tuned on its float weights is not applied to it, and its own verdict
    is kept apart."""
    import dataclasses

    engine, _ = tiny_engine("llama")
    floating = (engine.loaded, engine.device, engine.dtype)
    quantized = (dataclasses.replace(engine.loaded, quantize="gguf"), engine.device, engine.dtype)
    report = _report(40.0, {2: (60.0, 0.6)})
    tuning.save_choice(*floating, tuning.pick_depth(report), report)
    assert tuning.tuned(*floating) == {"depth": 2}
    assert tuning.tuned(*quantized) == {}
    report = _report(40.0, {1: (30.0, 0.5)})
    tuning.save_choice(*quantized, tuning.pick_depth(report), report)
    assert tuning.tuned(*quantized) == {"mode": "ar"} and tuning.tuned(*floating) == {"depth": 2}


def test_each_pass_of_a_seeded_measurement_samples_a_new_seed():
    """One seed fixes one trajectory per prompt: a second pass over the same seed adds no draw."""
    from mtplx.benchmarking import measure

    engine, _ = tiny_engine("llama")
    seeds, generate = [], engine.generate

    def recording(*args, **kwargs):
        seeds.append(kwargs.get("seed"))
        return generate(*args, **kwargs)

    engine.generate = recording
    measure(engine, depths=(1,), prompts=([5, 6, 7],), max_tokens=4, repeats=3, temperature=0.8, seed=40)
    assert seeds[0] == 40 and seeds[1:] == [40] * 2 + [41] * 2 + [42] * 2  # warm-up, then AR and d1 per pass
    seeds.clear()
    measure(engine, depths=(1,), prompts=([5, 6, 7],), max_tokens=4, repeats=2)
    assert set(seeds) == {None}  # greedy: nothing to vary


def test_measure_takes_draft_policies_by_configuration():
    """Each configuration runs its own draft policy; a policy passed with the sampling settings
    would be overridden by it unseen (benchmarks/gpu.py measured argmax drafts as "mirror")."""
    from mtplx.benchmarking import measure

    engine, _ = tiny_engine("llama")
    policies, generate = [], engine.generate

    def recording(*args, **kwargs):
        policies.append((kwargs.get("mode"), kwargs.get("draft_policy")))
        return generate(*args, **kwargs)

    engine.generate = recording
    report = measure(engine, depths=(1,), prompts=([5, 6, 7],), max_tokens=4, draft_policies=("mirror",),
                     temperature=0.8, seed=3)
    assert policies[1:] == [("ar", None), ("mtp", "mirror")]
    assert report["configs"]["mtp_d1_mirror"]["draft_policy"] == "mirror"
    with pytest.raises(TypeError, match="draft_policies"):
        measure(engine, depths=(1,), prompts=([5, 6, 7],), max_tokens=4, draft_policy="mirror", temperature=0.8)


def test_cycle_costs_come_from_the_runs_of_the_named_draft_policy():
    report = _report(100.0, {1: (120.0, 0.5)})
    report["configs"]["mtp_d1_mirror"] = {"mode": "mtp", "depth": 1, "tok_s": 150.0, "acceptance_rate": 0.5,
                                          "acceptance_by_depth": [0.5], "draft_policy": "mirror"}
    assert tuning.depth_costs(report).cycles == pytest.approx((1.5 * 100 / 120,))
    assert tuning.depth_costs(report, draft_policy="mirror").cycles == pytest.approx((1.5 * 100 / 150,))


def test_a_forged_head_replaced_in_its_folder_is_tuned_again():
    """The key names a forged head by its folder and its weights' sha256 (from its record): a
    new head copied over the old one (forge verify --replace, a new shipped head) does not
    inherit the old one's verdict; a head without a record keys by its folder alone."""
    from types import SimpleNamespace

    def loaded(provenance):
        return SimpleNamespace(source=None, head=object(), quantize=None, head_quantize=None,
                               head_info={"source": "/heads/h", "provenance": provenance})

    old, new = loaded({"weights_sha256": "a" * 64}), loaded({"weights_sha256": "b" * 64})
    key = tuning.model_key(old, "cpu", torch.float32)
    assert "head=/heads/h@" + "a" * 16 in key
    assert key != tuning.model_key(new, "cpu", torch.float32)
    assert "head=/heads/h|" in tuning.model_key(loaded(None), "cpu", torch.float32)
