"""The plugin contract: discovery, isolation, duplicates, API versions, env switches, light imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from ds4_core import PLUGIN_API_VERSION, hookspecs
from ds4_core.descriptors import BackendSpec, KernelSpec, ModelSpec, resolve
from ds4_core.errors import PluginError
from ds4_core.hookspecs import hookimpl
from ds4_core.testing import assert_kernels_match, check_registry, fresh_plugin_manager

GPU_MODULES = ("cupy", "mlx", "hip", "torch", "transformers")


def make_plugin(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    return module


def backend_plugin(name: str, backend: str) -> types.ModuleType:
    def register_backends(register):
        register(BackendSpec(name=backend, device="cpu", probe="ds4_core.backends.numpy:probe",
                             factory="ds4_core.backends.numpy:NumpyBackend"))

    return make_plugin(name, register_backends=register_backends)


def test_builtin_registry_resolves_and_has_numpy_backend():
    reg = fresh_plugin_manager().registry
    assert "numpy" in reg.backends
    assert {"linear", "rms_norm"} <= reg.ops()
    assert check_registry(reg) == []


def test_installed_plugins_are_sound():
    from ds4_core.plugins import PluginManager

    pm = PluginManager()
    assert pm.errors() == []
    assert check_registry(pm.registry) == []
    assert "deepseek4" in pm.registry.models


def test_duplicate_backend_names_raise_naming_both_distributions():
    a, b = backend_plugin("plug_a", "twin"), backend_plugin("plug_b", "twin")
    b.__dist__ = "ds4-backend-b"
    a.__dist__ = "ds4-backend-a"
    with pytest.raises(PluginError, match=r"ds4-backend-a.*ds4-backend-b"):
        fresh_plugin_manager(a, b).errors()


def test_a_failing_hook_is_isolated_and_reported():
    def register_models(register):
        raise RuntimeError("boom in plugin")

    pm = fresh_plugin_manager(make_plugin("broken", register_models=register_models), backend_plugin("ok", "ok"))
    reg = pm.registry
    assert "ok" in reg.backends
    (error,) = pm.errors()
    assert error.name == "broken" and "boom in plugin" in error.error


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("DS4_STRICT_PLUGINS", "1")

    def register_models(register):
        raise RuntimeError("boom")

    with pytest.raises(PluginError, match="boom"):
        fresh_plugin_manager(make_plugin("broken", register_models=register_models)).errors()


def test_unknown_hook_is_rejected_as_a_load_error():
    def register_everything(register):
        pass

    pm = fresh_plugin_manager(make_plugin("typo", register_everything=register_everything))
    (error,) = pm.errors()
    assert "register_everything" in error.error


def test_plugin_api_version_is_checked():
    plugin = backend_plugin("future", "future")
    plugin.DS4_PLUGIN_API = PLUGIN_API_VERSION + 1
    pm = fresh_plugin_manager(plugin)
    assert "future" not in pm.registry.backends
    assert "plugin API" in pm.errors()[0].error


def test_descriptor_refs_must_be_module_attr():
    with pytest.raises(PluginError, match="module:attr"):
        BackendSpec(name="x", device="cpu", probe="no_colon", factory="a:b")
    with pytest.raises(PluginError, match="cannot import"):
        resolve("ds4_no_such_module:thing")
    with pytest.raises(PluginError, match="no attribute"):
        resolve("ds4_core.ops:no_such_op")


def test_kernel_without_numpy_reference_is_reported():
    def register_kernels(register):
        register(KernelSpec("exotic", "fastbox", "ds4_core.ops:linear"))

    pm = fresh_plugin_manager(make_plugin("k", register_kernels=register_kernels))
    assert any("no numpy reference" in p for p in check_registry(pm.registry))


def unclamped_swiglu(gate, up, limit):
    """A swiglu kernel that forgets its limit."""
    from ds4_core.ops import swiglu

    return swiglu(gate, up, 0.0)


def _swiglu_case(rng):
    gate, up = (rng.normal(0, 8, (4, 64)).astype(np.float32) for _ in range(2))
    return (gate, up, 7.0), {}


def test_assert_kernels_match_passes_a_real_kernel_and_names_the_op_of_a_wrong_one():
    mx = pytest.importorskip("mlx.core")

    def register_kernels(register):
        register(KernelSpec("swiglu", "unclamped", f"{__name__}:unclamped_swiglu"))

    registry = fresh_plugin_manager(make_plugin("k", register_kernels=register_kernels),
                                    load_entrypoints=True).registry
    assert ("swiglu", "metal") in registry.kernels
    assert_kernels_match(registry, "metal", {"swiglu": _swiglu_case}, to_backend=mx.array, to_numpy=np.array)
    with pytest.raises(AssertionError, match="op 'swiglu' output 0 on backend 'unclamped'"):
        assert_kernels_match(registry, "unclamped", {"swiglu": _swiglu_case}, to_backend=np.asarray,
                             to_numpy=np.asarray)


def test_model_ops_must_exist():
    def register_models(register):
        register(ModelSpec(name="m", architectures=("m",), loader="ds4_core.ops:linear", ops=("warp_drive",)))

    reg = fresh_plugin_manager(make_plugin("m", register_models=register_models)).registry
    assert any("warp_drive" in p for p in check_registry(reg))


def test_every_hook_is_documented():
    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("register_")]
    assert len(hooks) == 7
    for name in hooks:
        assert getattr(hookspecs, name).__doc__, name
        assert f"`{name}" in doc, f"{name} is not described in docs/architecture.md"


def _write_third_party(site: Path, name: str, body: str) -> None:
    """A real installed distribution (dist-info + entry point) on a private sys.path entry."""
    (site / f"{name}.py").write_text(textwrap.dedent(body))
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[ds4]\n{name} = {name}\n")


def _run_ds4(args: list[str], site: Path | None = None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **(env_extra or {}))
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    probe = textwrap.dedent(f"""
        import json, sys
        from ds4_core.cli import cli
        try:
            cli.main({args!r}, prog_name="ds4")
        except SystemExit as e:
            code = e.code
        heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({GPU_MODULES!r}))
        print("HEAVY=" + json.dumps(heavy))
        sys.exit(code or 0)
    """)
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)


def test_help_and_plugins_import_no_gpu_library():
    for args in (["--help"], ["plugins"], ["backends"]):
        proc = _run_ds4(args)
        assert proc.returncode == 0, proc.stderr
        heavy = json.loads(proc.stdout.rsplit("HEAVY=", 1)[1])
        assert heavy == [], f"ds4 {' '.join(args)} imported {heavy}"


def test_broken_third_party_plugin_does_not_stop_ds4(tmp_path):
    _write_third_party(tmp_path, "ds4_broken_fixture", "raise ImportError('this plugin is broken on purpose')\n")
    proc = _run_ds4(["plugins"], site=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.split("HEAVY=")[0])
    broken = next(p for p in report if p["name"] == "ds4_broken_fixture")
    assert "broken on purpose" in broken["error"]
    assert any(p["name"] == "deepseek4" and p["error"] is None for p in report)
    assert "broken on purpose" in proc.stderr  # reported loudly, not swallowed
    assert _run_ds4(["--help"], site=tmp_path).returncode == 0


def test_third_party_command_and_disable_switches(tmp_path):
    _write_third_party(tmp_path, "ds4_hello_fixture", """
        import click
        from ds4_core.hookspecs import hookimpl

        @click.command()
        def hello():
            '''Say hello from a third-party plugin.'''
            click.echo("hello from plugin")

        @hookimpl
        def register_commands(cli):
            cli.add_command(hello)
    """)
    assert "hello from plugin" in _run_ds4(["hello"], site=tmp_path).stdout
    assert "hello" in _run_ds4(["--help"], site=tmp_path).stdout
    off = _run_ds4(["hello"], site=tmp_path, env_extra={"DS4_DISABLE_PLUGINS": "ds4_hello_fixture"})
    assert off.returncode != 0 and "No such command" in off.stderr
    only = _run_ds4(["plugins"], site=tmp_path, env_extra={"DS4_LOAD_PLUGINS": "ds4_hello_fixture"})
    names = [p["name"] for p in json.loads(only.stdout.split("HEAVY=")[0])]
    assert names == ["ds4_core.builtin", "ds4_hello_fixture"]


def test_trace_switch_logs_hook_calls(tmp_path):
    proc = _run_ds4(["plugins"], env_extra={"DS4_TRACE_PLUGINS": "1"})
    assert "register_backends" in proc.stderr
