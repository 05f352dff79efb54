"""User-facing errors: one clear line, shown by the CLI and server without a traceback."""


class ViasdError(Exception):
    """An error caused by the user's input or environment, with a message fit to show as is."""
