"""User-facing errors: one clear line, shown by the CLI and server without a traceback."""


class ViasdError(Exception):
    """An error caused by the user's input or environment, with a message fit to show as is."""


class UnsupportedParameter(ViasdError):
    """A generation parameter the chosen method cannot honour; `param` names it as the API does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
