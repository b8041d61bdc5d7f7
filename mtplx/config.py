"""User settings: ``~/.mtplx/config.toml`` (``$MTPLX_CONFIG`` overrides the path).

Precedence: command-line flag > environment (``MTPLX_<KEY>``, e.g. ``MTPLX_SCHEDULER_MODE``)
> config file > default. The file is a flat TOML table of the keys below; an absent key means
"use the default". Every bad value is reported with the key, the value, where it came from
and what is allowed; a malformed file with its path and line.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from mtplx.batching.state import DEFAULT_MAX_QUEUED, SchedulerMode
from mtplx.errors import MtplxError


class ConfigError(MtplxError):
    """A config value, variable or file is invalid."""


# keys whose command-line flag is not "--" + the key with dashes (named in error messages)
FLAG_NAMES = {"max_queued_requests": "--max-queue"}


@dataclass(frozen=True)
class Key:
    """One setting: ``convert`` turns text (env, ``config set``) or a TOML value into the
    setting's value, or raises ValueError; ``allowed`` says what is accepted."""

    name: str
    convert: Callable[[Any], Any]
    allowed: str
    secret: bool = False

    @property
    def env(self) -> str:
        return f"MTPLX_{self.name.upper()}"


def _int(lo: int, hi: int, optional: bool = True) -> Callable[[Any], Any]:
    def convert(v):
        if optional and v in (None, "auto"):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().lstrip("-").isdigit():
            raise ValueError
        v = int(v)
        if not lo <= v <= hi:
            raise ValueError
        return v
    return convert


def _depth(v):
    """A draft depth: 1..8, or "auto" (adaptive depth, a value here, not the default); None or
    "" unset it."""
    if v in (None, ""):
        return None
    return "auto" if v == "auto" else _int(1, 8, optional=False)(v)


def _float(lo: float, hi: float) -> Callable[[Any], Any]:
    def convert(v):
        if v in (None, "auto"):
            return None
        if isinstance(v, bool):
            raise ValueError
        v = float(v)  # ValueError/TypeError for junk
        if not lo <= v <= hi:
            raise ValueError
        return v
    return convert


def _choice(choices: tuple[str, ...], optional: bool) -> Callable[[Any], Any]:
    def convert(v):
        if optional and v in (None, "auto"):
            return None
        if v not in choices:
            raise ValueError
        return v
    return convert


def _device(v):
    if v in (None, "auto"):
        return None
    if not isinstance(v, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", v):
        raise ValueError
    return v


def _text(v):
    if v in (None, ""):
        return None
    if not isinstance(v, str):
        raise ValueError
    return v


def _key(v):
    """An API key: unset where empty (an empty variable), refused where blank (no client could
    send it: every request would get 401)."""
    v = _text(v)
    if v is not None and not v.strip():
        raise ValueError
    return v


def _required_text(v):
    if _text(v) is None:
        raise ValueError
    return v


KEYS: dict[str, Key] = {k.name: k for k in (
    Key("model", _text, "a Hugging Face model directory or a .gguf file (unset: SmolLM2-135M-Instruct)"),
    Key("scheduler_mode", lambda v: SchedulerMode(v),
        f"one of {', '.join(SchedulerMode.choices())}"),
    Key("generation_mode", _choice(("mtp", "ar"), True), "mtp, ar or auto (mtp when the model has a head)"),
    Key("depth", _depth, "an integer from 1 to 8, or auto (chosen cycle by cycle, up to max_depth)"),
    Key("max_depth", _int(1, 8), "the deepest a depth=auto cycle drafts: an integer from 1 to 8, or auto (3)"),
    Key("host", _required_text, "a host name or IP address"),
    Key("port", _int(1, 65535, optional=False), "an integer from 1 to 65535"),
    Key("max_active_requests", _int(1, 1024), "an integer from 1 to 1024, or auto (the mode's default)"),
    Key("decode_batch_max", _int(1, 256), "an integer from 1 to 256, or auto (the mode's default)"),
    Key("batch_wait_ms", _float(0, 60_000), "milliseconds from 0 to 60000, or auto (the mode's default)"),
    Key("max_queued_requests", _int(1, 100_000, optional=False), "an integer from 1 to 100000"),
    Key("device", _device, "cpu, cuda, cuda:N or auto"),
    # the names mtplx.runtime.DTYPES accepts (not imported here: it would pull in torch)
    Key("dtype", _choice(("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"), True),
        "float32, bfloat16, float16 (or fp32, bf16, fp16) or auto"),
    Key("quantize", _choice(("none", "gguf", "int4", "int8", "fp8"), True),
        "none, gguf (a GGUF file's own quantized blocks), int4, int8, fp8 or auto (gguf for a GGUF file on "
        "the CPU, a quantized checkpoint's own integers, else none)"),
    Key("kv_dtype", _choice(("float32", "fp32", "float16", "fp16", "bfloat16", "bf16"), True),
        "float32, float16, bfloat16 (or fp32, fp16, bf16) or auto (float16 on the CPU for a float32 model, "
        "else the model's dtype)"),
    Key("head_quantize", _choice(("none", "int8", "int4", "fp8"), True),
        "none, int8, int4, fp8 (the MTP head's linear weights) or auto (none: the head's own dtype)"),
    Key("tensor_parallel", _int(1, 64, optional=False),
        "an integer from 1 to 64: processes (one per GPU) the model is split across"),
    Key("api_key", _key, "a string clients send as 'Authorization: Bearer KEY' (not blank)", secret=True),
)}


def config_path() -> Path:
    return Path(os.environ.get("MTPLX_CONFIG") or Path.home() / ".mtplx" / "config.toml").expanduser()


def convert(name: str, value: Any, source: str) -> Any:
    """``value`` for key ``name`` checked and converted; ConfigError names all three and what is allowed."""
    key = KEYS.get(name)
    if key is None:
        raise ConfigError(f"{source}: unknown key {name!r}; known keys: {', '.join(KEYS)}")
    try:
        return key.convert(value)
    except (ValueError, TypeError):
        shown = "***" if key.secret else repr(value)
        raise ConfigError(f"{name} = {shown} ({source}) is not allowed: {name} must be {key.allowed}") from None


@dataclass
class Config:
    model: str | None = None
    scheduler_mode: SchedulerMode = SchedulerMode.SERIAL
    generation_mode: str | None = None
    depth: int | str | None = None
    max_depth: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_active_requests: int | None = None
    decode_batch_max: int | None = None
    batch_wait_ms: float | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    kv_dtype: str | None = None
    head_quantize: str | None = None
    tensor_parallel: int = 1
    api_key: str | None = None
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, path: Path | str | None = None, *, env: dict[str, str] | None = None,
             overrides: dict[str, Any] | None = None, keys: tuple[str, ...] | None = None) -> Config:
        """Defaults, then the file, then ``MTPLX_*`` variables, then ``overrides`` (command-line
        flags: a None value means the flag was not given). ``keys``: read (and check) only these
        from the file and the environment; the others keep their defaults."""
        path = Path(path) if path is not None else config_path()
        env = os.environ if env is None else env
        cfg = cls()
        cfg.sources = {name: "default" for name in KEYS}
        for name, value in read_file(path, keys).items():
            cfg._set(name, value, f"config file {path}")
        for name, key in KEYS.items():
            if keys is not None and name not in keys:
                continue
            if env.get(key.env, "") != "":
                cfg._set(name, convert(name, env[key.env], f"environment {key.env}"), f"environment {key.env}")
        for name, value in (overrides or {}).items():
            if value is not None:
                flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
                cfg._set(name, convert(name, value, f"flag {flag}"), f"flag {flag}")
        return cfg

    def _set(self, name: str, value: Any, source: str) -> None:
        setattr(self, name, value)
        self.sources[name] = source

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def as_dict(self, reveal_secrets: bool = False) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            if KEYS[f.name].secret and value is not None and not reveal_secrets:
                value = "***"
            out[f.name] = value.value if isinstance(value, SchedulerMode) else value
        return out


# -- the file ----------------------------------------------------------------------------------
_LINE_IN_ERROR = re.compile(r"at line (\d+)")


def read_file(path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The file's settings, each checked (``keys``: only these); {} when the file does not
    exist. Every entry that is wrong is named in one error."""
    text, raw = _read_toml(path)
    values, problems = {}, []
    for name, value in raw.items():
        if keys is not None and name not in keys:
            continue
        where = f"config file {path}, line {_line_of(text, name)}"
        try:
            if isinstance(value, (dict, list)):
                raise ConfigError(f"{where}: {name} must be a plain value, not a table or array")
            values[name] = convert(name, value, where)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems) if len(problems) == 1 else
                          f"{len(problems)} problems: " + "; ".join(problems))
    return values


def _read_toml(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's text and its table, values unchecked; ("", {}) when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "", {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = _LINE_IN_ERROR.search(str(exc))
        where = f", line {found.group(1)}" if found else ""
        raise ConfigError(f"config file {path}{where}: invalid TOML: {exc}") from None
    return text, raw


def _line_of(text: str, name: str) -> int | str:
    pattern = re.compile(rf"^\s*(?:[\"']?{re.escape(name)}[\"']?\s*[=.]|\[+\s*[\"']?{re.escape(name)}[\"']?\s*[\].])")
    return next((i for i, line in enumerate(text.splitlines(), 1) if pattern.match(line)), "?")


def set_value(name: str, text: str, path: Path | None = None) -> Any:
    """Check ``text`` for key ``name`` and write it to the file (creating it); returns the
    value. The values "auto" and "" remove the key (back to the default), except for depth,
    where "auto" is adaptive depth (``unset`` removes it). The file's other entries are kept as
    they are, a bad or unknown one too: so a file can be mended a key at a time."""
    path = path or config_path()
    removes = text in ("auto", "") and name != "depth"  # every key's default, never a literal "auto"
    value = None if removes and name in KEYS else convert(name, text, "config set")
    _, values = _read_toml(path)
    if value is None:
        values.pop(name, None)
    else:
        values[name] = value
    write_file(path, values)
    return value


def unset_value(name: str, path: Path | None = None) -> bool:
    """Remove key ``name`` from the file (back to the default); an unknown key the file holds
    is removed too. The file's other entries are kept as they are. False (the file untouched)
    where the file did not hold it."""
    path = path or config_path()
    _, values = _read_toml(path)
    if name not in KEYS and name not in values:
        raise ConfigError(f"unknown key {name!r}; known keys: {', '.join(KEYS)}")
    if name not in values:
        return False
    values.pop(name)
    write_file(path, values)
    return True


def write_file(path: Path, values: dict[str, Any]) -> None:
    """Write ``values`` as a flat TOML table (known keys in their documented order, then any
    others the file held), atomically. A table or array the file held is not written back:
    ConfigError says which, and how to remove it."""
    nested = [k for k, v in values.items() if isinstance(v, (dict, list))]
    if nested:
        raise ConfigError(f"config file {path} holds {', '.join(nested)}, a table or array (settings are plain "
                          f"values), which cannot be written back: `mtplx config unset {nested[0]}` removes it")
    lines = ["# mtplx settings (`mtplx config show` lists every key; flags and MTPLX_* variables win)"]
    for name in [*KEYS, *(k for k in values if k not in KEYS)]:
        if values.get(name) is not None:
            lines.append(f"{_toml_key(name)} = {_toml_value(values[name])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if any(name in KEYS and KEYS[name].secret for name in values):
        tmp.chmod(0o600)  # it holds a secret
    tmp.replace(path)


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _toml_value(value: Any) -> str:
    if isinstance(value, SchedulerMode):
        value = value.value
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "isoformat"):  # a TOML date or time, kept as the file had it
        return value.isoformat()
    return repr(value)
