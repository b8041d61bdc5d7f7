"""Shared pieces of the server tests (no tests here): a tiny engine that speaks text, and a
real uvicorn server on a free 127.0.0.1 port in a background thread."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import uvicorn

from mtplx.batching.job import Delta
from mtplx.engine.llm_engine import Engine
from mtplx.loading.checkpoint import LoadedModel
from mtplx.loading.tokenizer import Tokenizer
from mtplx.server.security import HEAD_BUFFER_BYTES
from tests.tiny_models import hf_reference, ours_from_hf, random_head, repeat_head

# ">> " as the generation prompt: the tiny random model then rarely emits EOS early
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}>> {% endif %}")


def char_tokenizer() -> Tokenizer:
    """A 96-token character tokenizer (ids 0-2 special, 2 = eos) matching the tiny models'
    vocabulary, with a chat template, so tiny models produce real text."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127) if chr(c) not in "`~^"] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert len(vocab) == 96
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    rust.decoder = decoders.Fuse()
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return Tokenizer(hf, name="char96")


def tiny_text_engine(*, head: str | None = "repeat", kv_cache_tokens: int = 4096, context: int = 256) -> Engine:
    """A tiny random Llama (vocab 96, ``context`` positions) with the character tokenizer and
    an MTP head: "repeat" (drafts often accepted), "random" (rarely), or None (AR only)."""
    hf, cfg = hf_reference("llama", max_position_embeddings=context)
    model = ours_from_hf(hf, cfg)
    mtp = None
    if head == "random":
        mtp = random_head(model)
    elif head == "repeat":
        mtp = random_head(model)
        mtp.load_state_dict(repeat_head(model).state_dict())
    loaded = LoadedModel(model, mtp, char_tokenizer(), model.config, source=None)
    return Engine(loaded, kv_cache_tokens=kv_cache_tokens, block_size=4)


@contextlib.contextmanager
def running_server(app, timeout: float = 30.0):
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port), its HTTP layer set as `mtplx serve`
    sets it (h11 and its head buffer); yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http="h11",
                                           h11_max_incomplete_event_size=HEAD_BUFFER_BYTES,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


class Collector:
    """An ``emit`` callback that gathers one job's events."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.deltas: list[Delta] = []

    def __call__(self, event) -> None:
        self.events.put(event)

    def wait(self, timeout: float = 60.0):
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Delta):
                self.deltas.append(event)
            else:
                return event
