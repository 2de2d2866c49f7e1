"""Errors every fuselm command raises; the CLI maps them to exit codes without a traceback."""


class FuselmError(Exception):
    """Bad usage or bad input (exit 2). The message names the problem and the fix."""

    exit_code = 2


class Unsupported(FuselmError):
    """The checkpoint's architecture is one an exporter cannot express (exit 2)."""


class CheckFailed(Exception):
    """A check or validation ran and failed (exit 1)."""

    exit_code = 1


def shown(value, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters, for messages about untrusted input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
