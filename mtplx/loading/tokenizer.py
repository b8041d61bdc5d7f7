"""Tokenizers: text <-> token ids, chat templates, and streaming detokenisation.

``Tokenizer`` wraps a transformers fast tokenizer (used for tokenisation and chat templates only).
From a Hugging Face directory it is ``AutoTokenizer``; from a GGUF file with a byte-level BPE
vocabulary (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen) it is built here from the
file's vocabulary and merges, which takes ~0.5 s instead of ~6 s through transformers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from mtplx.errors import ModelLoadError, MtplxError
from mtplx.loading.gguf_file import read_gguf_header

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence



def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as the printable character vocabularies
    spell it with, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns for byte-level vocabularies, keyed by tokenizer.ggml.pre. Llama 3 groups digits
# by three, Qwen 2 keeps them single; both keep letters with one leading non-letter.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizer names that use GPT-2's own split; "smollm" additionally splits digits one by one.
_GPT2_SPLIT_NAMES = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "olmo"}


class Tokenizer:
    """Text <-> ids for one model, plus its chat template and end-of-sequence ids."""

    def __init__(self, hf_tokenizer, eos_token_ids: Iterable[int] = (), name: str = "model"):
        """``hf_tokenizer``: a transformers fast tokenizer; ``eos_token_ids``: extra stop ids
        (e.g. from generation_config.json) besides the tokenizer's own eos token."""
        self._hf = hf_tokenizer
        self.name = name
        # decoding straight through the Rust tokenizer where transformers would return its text
        # unchanged (no clean-up of spaces): transformers' own decode wraps a 2 us call in about 12
        # us of Python, twice per streamed piece (IncrementalDecoder), per sequence per cycle
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend_decode = None
        if isinstance(backend, RustTokenizer) and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", True):
            self._backend_decode = backend.decode
        own_eos = hf_tokenizer.eos_token_id
        self._eos_token_ids = {own_eos} if own_eos is not None else set()
        self.add_eos_ids(eos_token_ids)

    # --- construction ---

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model directory, or None if it has no tokenizer files."""
        path = Path(path)
        if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer  # heavy import, only when needed

        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, ImportError) as exc:
            raise ModelLoadError(f"could not load the tokenizer in {path}: {exc}") from exc
        return cls(hf, eos_token_ids, name=path.name)

    @classmethod
    def from_gguf(cls, path: Path, metadata: dict | None = None, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata.

        ``metadata``: the file's raw metadata if already read (e.g. from ``load_gguf``).
        """
        path = Path(path)
        if metadata is None:
            metadata = read_gguf_header(path).metadata
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError(f"GGUF file {path} has no tokenizer (no tokenizer.ggml.tokens field)")
        kind = metadata.get("tokenizer.ggml.model")
        hf = _hf_from_gguf_bpe(metadata) if kind == "gpt2" else _hf_from_gguf_via_transformers(path, kind)
        return cls(hf, [*eos_token_ids, *_gguf_stop_ids(metadata)], name=path.stem)

    # --- properties ---

    @property
    def eos_token_ids(self) -> set[int]:
        """Ids that end generation: the eos token plus any added with ``add_eos_ids``."""
        return set(self._eos_token_ids)

    def add_eos_ids(self, ids: Iterable[int] | int | None) -> None:
        """Also stop on ``ids`` (an int, a list of ints, or None as in generation_config.json)."""
        if ids is None:
            return
        self._eos_token_ids.update([ids] if isinstance(ids, int) else ids)

    @property
    def hf(self):
        """The wrapped transformers tokenizer (e.g. for ``save_pretrained``)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self._hf)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the model's BOS/EOS if it uses them."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences appear as U+FFFD."""
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode`` leaves the token out of the text (a control token: BOS, EOS, a
        chat template's markers)."""
        special = self.__dict__.get("_special")
        if special is None:
            special = self.__dict__["_special"] = frozenset(self._hf.all_special_ids)
        return token_id in special

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens: their text), also where they are part
        of a UTF-8 character, which ``decode`` gives as U+FFFD: through the byte-level alphabet
        of a byte-level BPE vocabulary, or a byte-fallback token's ``<0xNN>``."""
        text = self.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHAR not in text:
            return text.encode("utf-8")
        piece = self._hf.convert_ids_to_tokens(token_id)
        backend = getattr(self._hf, "backend_tokenizer", None)
        if isinstance(getattr(backend, "decoder", None), decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return text.encode("utf-8")  # another scheme: what decoding gives

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}]``), as text."""
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self._require_chat_template(), **template_kwargs,
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> list[int]:
        """Token ids of the chat template applied to ``messages`` (no extra BOS added)."""
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self._hf.encode(text, add_special_tokens=False)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def _require_chat_template(self) -> str:
        if not self.has_chat_template:
            raise MtplxError(
                f"{self.name} has no chat template, so chat messages cannot be formatted; "
                "send a plain prompt (the completions endpoint) or use a model that ships a chat template"
            )
        return self._hf.chat_template


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces for streaming.

    The pieces, joined (including ``flush()``), equal ``tokenizer.decode(all_ids)``. Text ending
    in an incomplete UTF-8 character (U+FFFD) is held back until a later token completes it.
    Each step decodes only a short window of recent ids, so the cost per token is constant.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here gives stable leading text
        self._read = 0  # ids up to here have been turned into emitted text

    def push(self, new_ids: Iterable[int]) -> str:
        """Append ``new_ids`` and return the newly completed text ("" while a character is partial)."""
        self.ids.extend(new_ids)
        prefix_text, full_text = self._window_texts()
        if full_text.endswith(_REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full_text[len(prefix_text):]

    @property
    def pending(self) -> bool:
        """Whether ids pushed since the last text wait for a character's later bytes."""
        return self._read < len(self.ids)

    def flush(self) -> str:
        """Return whatever is still held back (e.g. a genuinely invalid byte sequence at the end)."""
        prefix_text, full_text = self._window_texts()
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        return prefix_text, full_text


# --- building tokenizers from GGUF metadata ---------------------------------------------------


def _hf_from_gguf_bpe(metadata: dict):
    """A transformers fast tokenizer for a byte-level BPE GGUF vocabulary."""
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    # Llama 3 style vocabularies take a whole-word token even when no merge path reaches it.
    ignore_merges = _SPLITS.get(pre) is _LLAMA3_SPLIT
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges)
    rust = RustTokenizer(bpe)
    rust.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    rust.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(rust, tokens, metadata.get("tokenizer.ggml.token_type", []))
    rust.post_processor = _bos_eos_processor(metadata, tokens)
    roles = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    specials = {name: _token(metadata, tokens, role) for name, role in roles.items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=rust,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in specials.items() if v is not None},
    )


def _byte_level_pre_tokenizer(pre: str):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2_SPLIT_NAMES:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known to mtplx; using GPT-2's split", stacklevel=3)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _add_gguf_added_tokens(rust: RustTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens: both are
    matched whole in the input instead of being split by BPE."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
    rust.add_special_tokens(special)
    rust.add_tokens(plain)


def _bos_eos_processor(metadata: dict, tokens: list[str]):
    """Post-processor adding BOS/EOS as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say."""
    wanted = {
        role: metadata.get(f"tokenizer.ggml.{role}_token_id")
        for role in ("bos", "eos")
        if metadata.get(f"tokenizer.ggml.add_{role}_token", False)
    }
    used = {role: (tokens[i], i) for role, i in wanted.items() if i is not None}
    head = [f"{used['bos'][0]}:0"] if "bos" in used else []
    tail = [f"{used['eos'][0]}:0"] if "eos" in used else []
    return processors.TemplateProcessing(
        single=[*head, "$A:0", *tail], pair=[*head, "$A:0", *tail, "$B:1", *tail], special_tokens=list(used.values())
    )


def _token(metadata: dict, tokens: list[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _gguf_stop_ids(metadata: dict) -> list[int]:
    """eos plus llama.cpp's end-of-turn/end-of-message ids, where the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [metadata[k] for k in keys if k in metadata]


def _hf_from_gguf_via_transformers(path: Path, kind: str | None):
    """Other vocabularies (sentencepiece ``llama``, ...): let transformers convert them (slower)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(
            f"could not build the {kind!r} tokenizer of GGUF file {path}: {exc}; byte-level BPE ('gpt2') "
            "vocabularies are built natively, others need transformers' GGUF support"
        ) from exc
