"""Suite-wide settings: under CI, hypothesis runs a fixed set of examples so a red build is reproducible."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
