"""The ds4 command line: help, errors without tracebacks, info/backends tables, run on a real tiny file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4_core.cli import cli


def ds4(*args: str, env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4_core.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=input, timeout=300)


def test_every_command_has_help():
    runner = CliRunner()
    for name in ("run", "info", "plugins", "backends", "convert"):
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output and "--help" in result.output


def test_missing_model_file_is_one_clear_line():
    proc = ds4("run", "-m", "/nonexistent/model.gguf", "-p", "hi")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model file")
    assert "Traceback" not in proc.stderr


def test_debug_flag_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    quiet = ds4("info", str(bad))
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr and "error:" in quiet.stderr
    loud = ds4("--debug", "info", str(bad))
    assert loud.returncode == 1 and "Traceback" in loud.stderr


def test_backends_table_lists_numpy_as_available():
    proc = ds4("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["numpy"]["available"] is True


def test_bad_option_values_are_rejected():
    result = CliRunner().invoke(cli, ["convert", "/", "out.gguf", "--outtype", "q9_9"])
    assert result.exit_code == 2 and "q9_9" in result.output
    result = CliRunner().invoke(cli, ["run", "-p", "hi", "-n", "0"])
    assert result.exit_code == 2 and "max-tokens" in result.output


def test_bad_sampling_values_fail_before_the_model_loads():
    proc = ds4("run", "-m", "/nonexistent-but-unread.gguf", "-p", "hi", "--temp", "nan")
    assert proc.returncode == 1 and "model file" in proc.stderr  # the path is checked first
    proc = ds4("run", "-p", "hi", "--temp", "nan")
    assert proc.returncode == 1 and "temperature" in proc.stderr and "embedded tiny" not in proc.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from ds4_model_deepseek4.tiny import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_info_on_a_real_file(tiny_model):
    proc = ds4("info", str(tiny_model))
    assert proc.returncode == 0, proc.stderr
    for text in ("deepseek4", "tensor types", "F32", "tokenizer", "deepseek4.block_count"):
        assert text in proc.stdout
    summary = json.loads(ds4("info", "--json", str(tiny_model)).stdout)
    assert summary["architecture"] == "deepseek4" and summary["parameters"] > 0


def test_run_streams_and_reports_speed(tiny_model):
    proc = ds4("run", "-m", str(tiny_model), "-p", "def fibonacci(n):", "-n", "12", "--seed", "1", "--temp", "0")
    assert proc.returncode == 0, proc.stderr
    assert "generation:" in proc.stderr and "t/s" in proc.stderr


def test_run_is_reproducible_with_a_seed(tiny_model):
    args = ("run", "-m", str(tiny_model), "-p", "hello", "-n", "16", "--seed", "7")
    assert ds4(*args).stdout == ds4(*args).stdout


def test_interactive_chat_reads_turns_until_eof(tiny_model):
    proc = ds4("run", "-m", str(tiny_model), "-n", "4", "--temp", "0", input="hello\nand again\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("generation:") == 2


def test_context_larger_than_allowed_is_refused(tiny_model):
    proc = ds4("run", "-m", str(tiny_model), "-p", "hi", "--ctx", str(10**9))
    assert proc.returncode == 1 and "context" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", sorted(__import__("ds4_core.testing.gguf_files", fromlist=["MALFORMED"]).MALFORMED))
def test_every_malformed_file_is_one_error_line_and_exit_1(case, tmp_path):
    from ds4_core.testing.gguf_files import MALFORMED

    path = tmp_path / f"{case}.gguf"
    path.write_bytes(MALFORMED[case].build())
    result = CliRunner().invoke(cli, ["run", "-m", str(path), "-p", "hi"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.output


def test_qat_rounding_flag_reaches_the_model(tiny_model):
    # the 2 MB fixture's indexer heads are 16 wide, too narrow for FP4 blocks: the plugin says so
    refused = ds4("run", "-m", str(tiny_model), "--raw", "-p", "hello", "-n", "2", "--qat-rounding")
    assert refused.returncode == 1 and "qat_rounding" in refused.stderr
    shipped = ds4("run", "--raw", "-p", "import os", "-n", "4", "--temp", "0", "--qat-rounding")
    assert shipped.returncode == 0, shipped.stderr


def test_unknown_model_option_is_one_clear_error(tiny_model):
    proc = ds4("run", "-m", str(tiny_model), "-p", "hi", "-O", "warp_factor=9")
    assert proc.returncode == 1 and "warp_factor" in proc.stderr and "Traceback" not in proc.stderr
    bad = ds4("run", "-m", str(tiny_model), "-p", "hi", "-O", "novalue")
    assert bad.returncode == 1 and "KEY=VALUE" in bad.stderr


def test_bench_without_a_gpu_says_why_in_one_line():
    from ds4_backend_cuda.probe import probe

    if probe()[0]:
        pytest.skip("a usable GPU is present: ds4 bench would run")
    proc = ds4("bench", "--layers", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ds4 bench measures the CUDA backend")
