"""The FUSELM_* on/off switches, read one way everywhere.

A switch is off when set to 0, off, false or no (any case), on when set to anything else, and its
default when unset or empty. Switches that take a count (FUSELM_THREADS, FUSELM_INFLIGHT,
FUSELM_LIMIT) are read by `number`, which names a bad value instead of raising a
bare ValueError; those that name a cache folder by `cache_folder`, which also gives fuselm's own
cache folders their one home (~/.cache/fuselm/NAME, $XDG_CACHE_HOME honoured); those that take a word
(FUSELM_CPU_ISA) are read where they are used.
"""

from __future__ import annotations

import os
from pathlib import Path

OFF = ("0", "off", "false", "no")


def setting(name: str) -> bool | None:
    """True / False when the switch `name` is set on / off, None when it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    return value not in OFF


def on(name: str, default: bool = False) -> bool:
    """Whether the switch `name` is on (`default` when unset)."""
    value = setting(name)
    return default if value is None else value


def number(name: str, default: int | None = None) -> int | None:
    """The count the switch `name` holds (`default` when unset or empty); a clear error when it is
    not a whole number >= 0."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        from fuselm.errors import FuselmError

        raise FuselmError(f"{name}={value!r} is not a whole number >= 0; set it to one (e.g. {name}=2) or unset it")
    return int(value)


def cache_folder(name: str, override: str | None = None, fallback: Path | None = None) -> Path:
    """The folder the environment variable `override` names when it is set, else `fallback` when given
    (another tool's folder the user set), else fuselm's cache folder `name`: $XDG_CACHE_HOME/fuselm/NAME,
    or ~/.cache/fuselm/NAME."""
    if override and os.environ.get(override, "").strip():
        return Path(os.environ[override].strip())
    if fallback is not None:
        return fallback
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuselm" / name
