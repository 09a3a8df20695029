"""Print ds4-core's runtime requirements (from pyproject.toml), one per line, for `pip download`."""

import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
print("\n".join(project["dependencies"]))
