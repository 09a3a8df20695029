"""Wheels of ds4-core and a plugin install offline into a fresh venv, and entry points find the plugin."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
WHEELHOUSE = ROOT / ".wheelhouse"


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_wheels_install_offline_and_the_plugin_is_discovered(tmp_path):
    assert WHEELHOUSE.is_dir(), "run `make setup`: it downloads the runtime wheels this test installs offline"
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist,
        ROOT, ROOT / "plugins/models/deepseek4")
    names = sorted(p.name for p in dist.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["ds4_core", "ds4_model_deepseek4"]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--no-index", "--find-links", dist, "--find-links", WHEELHOUSE,
        "ds4-core[deepseek4]")
    out = run(py, "-c", "from ds4_core.plugins import PluginManager; pm = PluginManager(); "
                        "print(sorted(pm.registry.models), [i.error for i in pm.errors()])", cwd=tmp_path)
    assert out.strip() == "['deepseek4'] []"
    assert "deepseek4" in run(env_dir / "bin" / "ds4", "plugins", cwd=tmp_path)
