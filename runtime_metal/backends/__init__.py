"""Backends: numpy (host shape work; the host reference), torch (CPU, CUDA, MPS), mlx (Metal; MLX's CPU
backend elsewhere). A backend is one module implementing base.Backend plus its branch in `make_backend`."""

from __future__ import annotations

import sys

from fuselm.errors import FuselmError


def mlx_metal_available() -> bool:
    if sys.platform != "darwin":
        return False
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 - any import or driver problem means "no Metal"
        return False


DTYPES = ("auto", "f32", "f16", "bf16")
NAMES = ("auto", "mlx", "torch", "numpy")  # --backend


def make_backend(backend: str = "auto", device: str | None = None, dtype: str = "auto", threads: int | None = None):
    """auto: MLX on a Mac with Metal, else torch on CUDA when there, else torch on CPU.

    `dtype` is the compute type of the graph's float32 values: auto = bf16 on a GPU (as mlx-lm and
    the checkpoints run), f32 on a CPU and for validation against onnxruntime."""
    if dtype not in DTYPES:
        raise FuselmError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if backend == "auto":
        if mlx_metal_available():
            backend = "mlx"
        else:
            import torch

            backend, device = "torch", device or ("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "mlx":
        try:
            from .mlx_backend import MLXBackend
        except ImportError as e:
            raise FuselmError(f"--backend mlx needs MLX ({e}); install it with `pip install mlx` (on Linux "
                              "`pip install 'mlx[cpu]'`)") from None
        b = MLXBackend(device)
        want = ("bf16" if b.device.startswith("gpu") else "f32") if dtype == "auto" else dtype
        return MLXBackend(device, want) if want != "f32" else b
    if backend == "torch":
        import torch

        from .torch_backend import TorchBackend

        try:
            dev = torch.device(device or "cpu")
        except RuntimeError as e:
            raise FuselmError(f"--device {device!r} is not a torch device ({e}); use cpu, cuda, cuda:N or mps") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise FuselmError(f"--device {device} asks for CUDA, but torch sees no CUDA device; use --device cpu")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise FuselmError("--device mps asks for Metal through torch, but MPS is not available; use --device cpu")
        if dtype not in ("auto", "f32"):
            raise FuselmError(f"--dtype {dtype} runs on the MLX backend; the torch backend computes in f32 (its CUDA "
                              "kernels take f32 activations): pass --dtype f32 or --backend mlx")
        return TorchBackend(str(dev), threads=threads)
    if backend == "numpy":
        from .numpy_backend import NumpyBackend

        if device not in (None, "cpu") or dtype not in ("auto", "f32"):
            raise FuselmError(f"--backend numpy is the host reference: f32 on the CPU (got --device {device}, --dtype "
                              f"{dtype}); leave both out, or use --backend torch or mlx")
        return NumpyBackend()
    raise FuselmError(f"unknown backend {backend!r}; choose {', '.join(NAMES)}")
