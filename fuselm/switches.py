"""The FUSELM_* on/off switches, read one way everywhere.

A switch is off when set to 0, off, false or no (any case), on when set to anything else, and its
default when unset or empty. Switches that take a count (FUSELM_THREADS, FUSELM_INFLIGHT,
FUSELM_LIMIT) are read by `number`, which names a bad value instead of raising a
bare ValueError; those that take a word or a folder (FUSELM_CPU_ISA, the cache folders) are read
where they are used.
"""

from __future__ import annotations

import os

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
