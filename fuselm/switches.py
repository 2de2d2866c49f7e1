"""The FUSELM_* on/off switches, read one way everywhere.

A switch is off when set to 0, off, false or no (any case), on when set to anything else, and its
default when unset or empty. Switches that take a value (FUSELM_THREADS, FUSELM_CPU_ISA, the cache
folders) are read where they are used; this module only settles what "off" means.
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
