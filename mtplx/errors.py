"""Errors a user can cause. Each message says what was wrong and what is allowed."""


class MtplxError(Exception):
    """Base class for user-facing errors (bad input, bad files, unsupported models)."""


class InvalidParameter(MtplxError, ValueError):
    """A request or call parameter is out of range.

    ``param`` names the parameter so servers can report it in the OpenAI error shape.
    """

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthExceeded(InvalidParameter):
    """The prompt does not fit the model's context (servers report OpenAI's
    ``context_length_exceeded``, which clients check to trim a conversation)."""


class ModelLoadError(MtplxError):
    """A model path, file or checkpoint could not be loaded."""


class UnsupportedModel(ModelLoadError):
    """The checkpoint's architecture is not one mtplx can run."""
