"""The engine's errors, torch-free (the router imports them): those a user can act on, each
with a message that names what is wrong and why, and the step's own failure, which the step
(engine/step.py) and its failure isolation (engine/step_isolation.py) share from here."""


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


class EngineError(PdserveError):
    """A request failed inside an engine step (its sampling, its bookkeeping, or a forward that
    fails whenever it is in the batch). It fails alone; its client gets this as an error
    (gRPC INTERNAL, details "engine error: <cause>"), never a normal finish."""

    prefix = "engine error"
    status_code = "INTERNAL"  # the gRPC status a worker ends the request's call with

    def __init__(self, cause: BaseException | str):
        self.cause = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{self.prefix}: {self.cause}")


class WorkerError(EngineError):
    """A step failed for every request in it, alone too: the worker is broken, not the request
    (gRPC UNAVAILABLE, details "worker error: <cause>": the router runs it elsewhere)."""

    prefix = "worker error"
    status_code = "UNAVAILABLE"


class StepUpdateError(RuntimeError):
    """The update after a forward raised outside any one request's work: the step is not run
    again (its tokens were already taken), and the loop's owner fails what is in flight."""
