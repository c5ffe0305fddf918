"""Errors a user can act on. Each carries a message that names what is wrong and why."""


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose (never a bare traceback for user input)."""


class ModelNotFoundError(PdserveError):
    """The model path does not exist or holds no loadable checkpoint."""


class UnsupportedModelError(PdserveError):
    """The checkpoint's architecture or a feature of its config is not supported."""


class InvalidRequestError(PdserveError, ValueError):
    """A request parameter is out of range; ``param`` names it (for 400 / INVALID_ARGUMENT)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message
