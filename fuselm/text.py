"""The texts quality is measured and calibrated on: the bundled public-domain defaults or a user's file,
tokenized and cut into teacher-forcing windows.

The bundled files (fuselm/data/) start with a header naming their source, ended by the first blank line;
a user's file is read whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import FuselmError

DATA = Path(__file__).parent / "data"
EVAL_TEXT = DATA / "botchan-1.txt"  # fuselm eval's default
CALIB_TEXT = DATA / "botchan-2.txt"  # convert's default calibration text (another chapter: eval stays unseen)
WINDOW = 512


def read_text(path: str | Path | None, default: Path = EVAL_TEXT) -> tuple[str, str]:
    """(text, its name): the file at `path`, or the bundled `default` without its header."""
    if path is None:
        return default.read_text(encoding="utf-8").split("\n\n", 1)[1], f"bundled {default.name}"
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FuselmError(f"cannot read the text {path} ({e}); pass a UTF-8 text file") from None
    if not text.strip():
        raise FuselmError(f"the text {path} is empty; pass a file with some prose in it")
    return text, str(path)


def windows(ids: list[int], window: int = WINDOW, max_tokens: int | None = None) -> list[np.ndarray]:
    """Consecutive `window`-token pieces of `ids` (int64 arrays; the first `max_tokens` of them); a remainder shorter than
    a window is dropped, unless the text is shorter than one window (then it is the one piece)."""
    ids = np.asarray(ids[:max_tokens] if max_tokens else ids, np.int64)
    if len(ids) < 2:
        raise FuselmError("the text gives fewer than 2 tokens; pass a longer text")
    if len(ids) < window:
        return [ids]
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
