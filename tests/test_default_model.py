"""The real default model (SmolLM2-135M-Instruct GGUF) decodes exactly like transformers."""

import pytest
import torch

import mtplx

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain what a hash table is in two sentences.",
    "List three uses of Python.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def engine(default_gguf):
    return mtplx.load(default_gguf, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(default_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(default_gguf.parent), default_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_greedy_chat_continuations_match_transformers(engine, hf_model_and_tokenizer):
    hf, hf_tok = hf_model_and_tokenizer
    for question in CHATS:
        messages = [{"role": "user", "content": question}]
        ids = engine.encode_prompt(messages, chat=True)
        assert ids == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        ours = engine.generate(messages, chat=True, mode="ar", max_tokens=NEW_TOKENS, ignore_eos=True)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert len(ours.token_ids) == NEW_TOKENS
        assert ours.token_ids == out, question


@pytest.mark.slow
def test_default_model_streams_text_and_reports_stats(engine):
    pieces = list(engine.stream("The three primary colors are", max_tokens=20))
    full = engine.generate("The three primary colors are", max_tokens=20)
    assert "".join(pieces) == full.text
    assert len(pieces) > 3
    assert full.stats["generated_tokens"] == len(full.token_ids)


@pytest.mark.slow
def test_stop_strings_cut_streamed_and_returned_text_alike(engine):
    full = engine.generate("Count from one to twenty: one, two,", max_tokens=40, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    result = engine.generate("Count from one to twenty: one, two,", max_tokens=40, ignore_eos=True, stop=[stop])
    streamed = "".join(engine.stream("Count from one to twenty: one, two,", max_tokens=40, ignore_eos=True,
                                     stop=[stop]))
    assert result.text == cut == streamed and result.finish_reason == "stop"


@pytest.fixture(scope="module")
def with_head(default_gguf):
    """The default model as ``mtplx.load()`` gives it: its GGUF's own blocks and the shipped head."""
    from mtplx.loading.default_model import default_head_dir

    return mtplx.load(default_gguf, head=default_head_dir())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "mtp"])
def test_a_repeated_prompt_decodes_as_it_did_when_new(with_head, mode):
    """The prefix cache serves a repeated prompt's full blocks, and the tail past them is
    computed after them whether the prompt is new or repeated (``Generator.cache_edge``): a
    seeded sampled request sent twice gives the same tokens and logprobs, bit for bit. (Before,
    the new prompt's tail was computed in one forward with the rest: other rounding.)"""
    engine = with_head
    messages = [{"role": "user", "content": f"In {mode} mode, describe how a bicycle's gears make a hill easier."}]
    runs = []
    for _ in range(2):
        req = engine.make_request(messages, chat=True, mode=mode, max_tokens=48, temperature=0.7, top_p=0.95, seed=5)
        req.logprobs = 2
        for seq, _ in engine.run(req):
            pass
        runs.append(seq)
    new, repeated = runs
    edge = engine.generator.cache_edge(new)
    assert len(new.prompt_ids) > edge > new.stats.cached_prompt_tokens  # a tail past the full blocks, new blocks
    assert repeated.stats.cached_prompt_tokens == edge
    assert repeated.generated == new.generated
    assert repeated.logprobs == new.logprobs


def _run(engine, messages, **kwargs):
    """(generated ids, text, finish reason, logprobs, stats) of one request with logprobs."""
    req = engine.make_request(messages, chat=True, **kwargs)
    req.logprobs = 1
    pieces = []
    for seq, piece in engine.run(req):
        pieces.append(piece)
    return seq.generated, "".join(pieces), seq.finish_reason, seq.logprobs, seq.stats


@pytest.mark.slow
def test_a_stop_string_ends_mtp_output_where_ar_ends_it(with_head):
    """A cycle commits up to depth + 1 tokens at once; where a stop string is completed by one of
    them, the tokens after it are not output: MTP at depth 3 gives the tokens, text, logprobs and
    token count that AR steps give, for stops completed at many points of the text."""
    engine = with_head
    messages = [{"role": "user", "content": "Count from 1 to 20 separated by commas."}]
    base = dict(max_tokens=40, ignore_eos=True)
    full = engine.generate(messages, chat=True, mode="ar", **base).text
    stops = sorted({full[i:i + 2] for i in range(2, len(full) - 2, 3)})
    assert len(stops) >= 6
    for stop in stops:
        ar = _run(engine, messages, mode="ar", stop=[stop], **base)
        mtp = _run(engine, messages, mode="mtp", depth=3, stop=[stop], **base)
        assert ar[2] == mtp[2] == "stop" and ar[1] == mtp[1] == full[: full.index(stop)], stop
        assert mtp[0] == ar[0] and len(mtp[3]) == len(ar[3]) == len(ar[0]), stop
        assert [t for t, _ in mtp[3]] == pytest.approx([t for t, _ in ar[3]], abs=1e-2)
        assert mtp[4].generated_tokens == len(ar[0])


@pytest.mark.slow
def test_the_default_models_file_under_another_path_gets_its_shipped_head(default_gguf, tmp_path):
    """`--model <the default GGUF>` (the cached file, or a copy elsewhere) is the same model as no
    --model at all: the shipped head attaches, verified against the file's sha256; a file of the
    same size with other bytes gets none."""
    import shutil
    import subprocess
    import sys

    from mtplx.loading.default_model import default_head_dir, shipped_head_for

    copy = tmp_path / "renamed.gguf"
    shutil.copy(default_gguf, copy)
    assert shipped_head_for(default_gguf) == shipped_head_for(copy) == default_head_dir() is not None
    engine = mtplx.load(copy)
    assert engine.has_mtp and engine.loaded.head_info["verified"]
    info = subprocess.run([sys.executable, "-m", "mtplx.cli", "inspect", str(copy)], capture_output=True, text=True)
    assert info.returncode == 0, info.stdout + info.stderr
    with open(copy, "r+b") as f:  # same size, one byte changed: not the default model
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert shipped_head_for(copy) is None
