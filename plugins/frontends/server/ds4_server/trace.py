"""``--trace FILE``: JSON lines recording prompts, cache decisions and generated text (may be sensitive)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class Tracer:
    """Appends one JSON object per event to ``path``; does nothing when ``path`` is None."""

    def __init__(self, path: str | Path | None):
        self._fh = open(path, "a", encoding="utf-8") if path else None  # kept open for the server's lifetime
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        line = json.dumps({"t": round(time.time(), 6), "event": event, **fields}, ensure_ascii=False, default=str)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()
