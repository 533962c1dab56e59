"""Atomic file writing, below every layer: checkpoints (train.py) and reports (report.py) both write through it."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data) -> Path:
    """Write `data` (str, bytes, or a callable taking a binary file) to a temporary file beside `path`,
    fsync, then rename over `path`: an interrupted write leaves the previous file untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
