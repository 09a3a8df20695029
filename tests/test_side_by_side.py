"""``benchmarks/side_by_side.py``'s parts that need no GPU: a git revision's backend files exported, a version's
files laid over a copy of the backend package, and the kernels-alone report read and tabulated."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def side_by_side(load_script):
    return load_script(ROOT / "benchmarks" / "side_by_side.py", "_side_by_side")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_export_writes_the_backend_and_model_files_of_a_revision(side_by_side, tmp_path):
    names = side_by_side.export("HEAD", tmp_path)
    backend = _git("ls-tree", "-r", "--name-only", "HEAD", side_by_side.PACKAGE).split()
    model = _git("ls-tree", "-r", "--name-only", "HEAD", side_by_side.MODEL_PACKAGE).split()
    data = [p for p in model if p.startswith(side_by_side.MODEL_DATA)]
    assert any(p.endswith(".gguf") for p in data)  # the shipped tiny model, left out
    assert names == sorted([p.removeprefix(side_by_side.PACKAGE + "/") for p in backend]
                           + [p.replace(side_by_side.MODEL_PACKAGE, "ds4_model_deepseek4") for p in model
                              if p not in data])
    assert {"kernels/quant_int8.cu", "ops.py", "ds4_model_deepseek4/model.py"} <= set(names)
    assert (tmp_path / "ops.py").read_text() == _git("show", f"HEAD:{side_by_side.PACKAGE}/ops.py")
    assert (tmp_path / "ds4_model_deepseek4" / "model.py").read_text() == _git(
        "show", f"HEAD:{side_by_side.MODEL_PACKAGE}/model.py")


def test_export_of_an_unknown_revision_says_which(side_by_side, tmp_path):
    with pytest.raises(SystemExit, match="no-such-revision"):
        side_by_side.export("no-such-revision", tmp_path)
    assert not any(tmp_path.iterdir())


def test_overlay_replaces_what_differs_and_refuses_a_wrong_layout(side_by_side, tmp_path):
    package = tmp_path / "ds4_backend_cuda"
    (package / "kernels").mkdir(parents=True)
    (package / "ops.py").write_text("old ops\n")
    (package / "kernels" / "quant.cu").write_text("same\n")
    version = tmp_path / "version"
    (version / "kernels").mkdir(parents=True)
    (version / "kernels" / "quant.cu").write_text("same\n")
    (version / "kernels" / "new.cu").write_text("new kernel\n")
    (version / "ops.py").write_text("new ops\n")
    assert side_by_side.overlay(version, package) == ["kernels/new.cu", "ops.py"]
    assert (package / "ops.py").read_text() == "new ops\n"
    assert (package / "kernels" / "new.cu").read_text() == "new kernel\n"

    (version / "kernel").mkdir()
    (version / "kernel" / "typo.cu").write_text("x\n")
    with pytest.raises(SystemExit, match="no directory kernel"):
        side_by_side.overlay(version, package)
    assert not (package / "kernel").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no files"):
        side_by_side.overlay(empty, package)


def test_overlay_lays_a_versions_model_files_over_the_model_copy_beside_the_backend(side_by_side, tmp_path):
    package, model = tmp_path / "ds4_backend_cuda", tmp_path / "ds4_model_deepseek4"
    package.mkdir()
    model.mkdir()
    (package / "ops.py").write_text("ops\n")
    (model / "model.py").write_text("old graph\n")
    version = tmp_path / "version"
    (version / "ds4_model_deepseek4").mkdir(parents=True)
    (version / "ds4_model_deepseek4" / "model.py").write_text("new graph\n")
    (version / "ops.py").write_text("ops\n")
    assert side_by_side.overlay(version, package) == ["ds4_model_deepseek4/model.py"]
    assert (model / "model.py").read_text() == "new graph\n"
    assert not (package / "ds4_model_deepseek4").exists()

    (version / "ds4_model_deepseek4" / "sub").mkdir()
    (version / "ds4_model_deepseek4" / "sub" / "x.py").write_text("x\n")
    with pytest.raises(SystemExit, match="ds4_model_deepseek4 has no directory sub"):
        side_by_side.overlay(version, package)


def test_kernel_times_reads_the_alone_report_and_the_table_lines_versions_up(side_by_side):
    main = ("copy bandwidth (read + write, as ds4 bench measures it) 4266 GB/s\n"
            "routed gate/up, handed         19.53 us    1329 GB/s    31% of copy\n"
            "attn_output_a + _b, both handed   21.16 us    3370 GB/s    79% of copy\n")
    times = side_by_side.kernel_times(main)
    assert times == {"routed gate/up, handed": 19.53, "attn_output_a + _b, both handed": 21.16}
    variant = side_by_side.kernel_times("routed gate/up, handed  18.80 us  1381 GB/s  33% of copy\n")
    table = side_by_side.kernel_table(["installed", ".ab/a-long-version-name"], [times, variant],
                                      "kernel alone, µs").splitlines()
    assert table[0].split()[-2:] == ["installed", "version-name"]
    assert table[1].split()[-2:] == ["19.53", "18.80"]
    assert table[2].split()[-2:] == ["21.16", "-"]


def test_step_times_reads_the_profile_table_and_the_table_lines_versions_up(side_by_side):
    main = ("f4.gguf: decode at 2048 tokens, graph replay: True; 78 kernels per step, GPU busy 0.932 ms per step\n"
            "  us/step per step  mean us  kernel\n"
            "    372.1     18.0    20.67  void gemv_i8<Q8_0, 1>(unsigned char const*, long long, int, int\n"
            "     33.2      5.0     6.65  void hc_expand_mix_norm<F16>(unsigned char const*, long long, int\n"
            "     25.4      4.0     6.35  route_linear_topk\n"
            "Session.feed + argmax: 1.025 ms per token (untraced); beyond the GPU's busy time: 0.093 ms\n"
            " start us      us  gap us  kernel\n"
            "      0.0    0.80    0.00  Memcpy HtoD (Pageable -> Device)\n")
    times = side_by_side.step_times(main)
    assert times == {"void gemv_i8<Q8_0, 1>": 372.1, "void hc_expand_mix_norm<F16>": 33.2, "route_linear_topk": 25.4}
    assert side_by_side.step_times("no table here\n") == {}
    variant = side_by_side.step_times("  us/step per step  mean us  kernel\n"
                                      "     12.4      3.0     4.13  void hc_expand_streams<F16>(unsigned char\n"
                                      "     20.1      4.0     5.03  route_linear_topk\n")
    table = side_by_side.kernel_table(["installed", "v"], [times, variant], "f4.gguf: kernel, µs a step")
    lines = table.splitlines()
    assert lines[0].startswith("f4.gguf: kernel, µs a step") and lines[0].split()[-2:] == ["installed", "v"]
    assert lines[3].split()[-2:] == ["25.40", "20.10"]
    assert lines[4].split()[-2:] == ["-", "12.40"]


def test_timeline_rows_keeps_the_header_and_the_last_rows_of_the_step(side_by_side):
    output = ("f4.gguf: decode at 1024 tokens, graph replay: True; 73 kernels per step, GPU busy 0.981 ms per step\n"
              "  us/step per step  mean us  kernel\n"
              "Session.feed + argmax: 0.864 ms per token (untraced); beyond the GPU's busy time: -0.122 ms\n"
              " start us      us  gap us  kernel\n"
              "      0.0    0.80    0.00  Memcpy HtoD (Pageable -> Device)\n"
              "    115.8    1.92  115.04  void dequant_rows<F16>(unsigned char const*, long long, int\n"
              "    133.8    1.54   -0.13  step_index\n"
              "    681.0   11.30    6.69  Memcpy DtoH (Device -> Pageable)\n"
              "2026-12-04T18:18:14Z [info     ] engine closed\n")
    rows = side_by_side.timeline_rows(output, 2)
    assert rows == [" start us      us  gap us  kernel", "    133.8    1.54   -0.13  step_index",
                    "    681.0   11.30    6.69  Memcpy DtoH (Device -> Pageable)"]
    assert len(side_by_side.timeline_rows(output, 24)) == 5  # the header and all four rows
    assert side_by_side.timeline_rows(output, 0) == []
    assert side_by_side.timeline_rows("  us/step per step  mean us  kernel\n", 5) == []
