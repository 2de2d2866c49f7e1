"""Which of two MLX forms runs a prompt chunk's 4-bit matmul: measured per device, kept per machine.

A matmul over at least WIDE_ROWS rows (a prompt chunk; decode is one row) can run as
`mx.quantized_matmul` ("quantized") or as the weight dequantized to the compute dtype and a plain GEMM
on that transient copy ("dequantize"). Which is faster depends on the device's kernels, the weight's
shape and the row count, so each (device, weight shape, row count rounded up to a power of two) is
timed once on the real weight, the first time it comes (a speed probe, not a device check: on Metal
the quantized kernel keeps the shapes where it wins), and the choice is kept in this process and in
FORMS_FILE in fuselm's cache folder "mlx" for later processes (FUSELM_MATMUL_FORMS_CACHE=0: this
process only). FUSELM_WIDE_DEQUANT=1 / 0 forces one form.
"""

from __future__ import annotations

import functools
import json
import os
import time

import mlx.core as mx

from fuselm import switches

from .base import QuantizedWeight

PER_EVAL = 4  # products per timed evaluation (the probe's, and bench/mlx_qmm_forms.py's default)
WIDE_ROWS = 64  # a matmul over at least this many rows (a prompt chunk) may run on a dequantized weight
FORMS_FILE = "matmul-forms.json"
_WIDE: dict[tuple, str] = {}  # (device, N, K, bits, block, dtype, rows) -> the choice, this process


def choose(w: QuantizedWeight, rows: int, dtype) -> tuple[tuple | None, str]:
    """(key, "quantized" or "dequantize") for x [rows, K] @ w on the default device (key None: forced)."""
    forced = switches.setting("FUSELM_WIDE_DEQUANT")
    if forced is not None:
        return None, "dequantize" if forced else "quantized"
    key = (_device_id(), w.out_features, w.in_features, w.bits, w.block, str(dtype), 1 << (rows - 1).bit_length())
    if key not in _WIDE:  # once per process: every session on this device makes the same choice
        _WIDE[key] = _stored_forms().get(_form_name(key)) or _store_form(key, _faster_form(w, key[-1], dtype))
    return key, _WIDE[key]


def products(x, wq, scales, biases, group: int, bits: int) -> dict:
    """The two forms of x @ wᵀ on MLX's affine 4/8-bit weight (wq, scales, biases), each a function that builds it
    (the probe below and bench/mlx_qmm_forms.py time these)."""
    return {"quantized": lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits),
            "dequantize": lambda: mx.matmul(x, dequantized(wq, scales, biases, group, bits, x.dtype).T)}


def dequantized(wq, scales, biases, group: int, bits: int, dtype):
    """The weight in `dtype`, [N, K]: what the "dequantize" form multiplies by."""
    return mx.dequantize(wq, scales, biases, group_size=group, bits=bits).astype(dtype)


def note(keys: set[tuple]) -> str:
    """What describe() says of the choices behind `keys` ("" when none was made)."""
    made = [k for k in keys if k in _WIDE]  # (a test may have started a fresh process's table since)
    if not made:
        return ""
    rows = sorted({k[-1] for k in made})
    dequantized = sum(_WIDE[k] == "dequantize" for k in made)
    return (f", prompt matmuls at {'/'.join(map(str, rows))} rows dequantized for {dequantized} of "
            f"{len(made)} weight shapes (measured faster)")


def _device_id() -> str:
    """The default device as the stored choices name it: MLX's version, the device and its name."""
    return _named(str(mx.default_device()))


@functools.cache
def _named(device: str) -> str:
    try:
        name = str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):
        name = ""
    return f"mlx{mx.__version__}/{device}/{name}".replace(" ", "_")


_STORED: dict[str, str] | None = None  # FORMS_FILE as this process first read it


def _form_name(key: tuple) -> str:
    """A _WIDE key as FORMS_FILE names it, e.g. "mlx0.32.4/Device(gpu,_0)/NVIDIA_H200 [19456 x 2560] q4 g64
    bfloat16 2048 rows"."""
    device, n, k, bits, block, dtype, rows = key
    return f"{device} [{n} x {k}] q{bits} g{block} {dtype.removeprefix('mlx.core.')} {rows} rows"


def _forms_path():
    return switches.cache_folder("mlx") / FORMS_FILE if switches.on("FUSELM_MATMUL_FORMS_CACHE", True) else None


def _read_forms(path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or damaged: measure again
        return {}
    return {k: v for k, v in data.items() if v in ("quantized", "dequantize")} if isinstance(data, dict) else {}


def _stored_forms() -> dict[str, str]:
    """The choices earlier processes measured on this machine (read once per process; {} when off)."""
    global _STORED
    if _STORED is None:
        path = _forms_path()
        _STORED = _read_forms(path) if path is not None else {}
    return _STORED


def _store_form(key: tuple, form: str) -> str:
    """Add one measured choice to FORMS_FILE (written whole to a temporary file, then renamed: a reader never
    sees half of it; two writers at once may drop each other's new entry, which is measured again). Returns
    `form`. A folder it cannot write is no error: the choice then lasts this process."""
    path = _forms_path()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            forms = {**_read_forms(path), _form_name(key): form}
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(forms, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass
    return form


def _faster_form(w: QuantizedWeight, rows: int, dtype) -> str:
    """"dequantize" when x [rows, K] @ dequantize(w)ᵀ ran at least 10 % faster here than mx.quantized_matmul,
    else "quantized". Each form is timed as PER_EVAL products in one evaluation (as a prompt chunk queues them: the
    wait for the device is paid once, not per kernel), best of 2 after a warm-up."""
    best = {}
    for name, fn in products(mx.zeros((rows, w.in_features), dtype), *w.data, w.block, w.bits).items():
        mx.eval(fn())
        times = []
        for _ in range(2):
            t = time.perf_counter()
            mx.eval([fn() for _ in range(PER_EVAL)])
            times.append(time.perf_counter() - t)
        best[name] = min(times)
    return "dequantize" if best["dequantize"] < 0.9 * best["quantized"] else "quantized"
