"""The benchmark scripts a GPU session runs in one call (bench/run_gpu.sh), checked where no GPU
is: the parts' files (the device tool brings back 8 at most), the deadline, the JSON each part
writes, and the GPU summaries computed from rows of the same shape."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_scaled  # noqa: E402
import gpu_parts  # noqa: E402

from lowfp.experiments import bench  # noqa: E402

PARTS = ("suite", "kernels", "optim", "emulate")


# Stands in for python3 in the GPU script: bench/gpu_parts.py runs for real, the GPU's compute
# capability is 9.0; a benchmark prints its arguments, writes {"by": "stub"} where --json names a
# file, and exits with status 3.
STUB_PYTHON = """#!/usr/bin/env bash
if [ "$1" = bench/gpu_parts.py ]; then exec "%s" "$@"; fi
case "$*" in *get_device_capability*) echo 90; exit 0;; esac
echo "benchmark $*"
while [ $# -gt 0 ]; do
  if [ "$1" = --json ]; then echo '{"by": "stub"}' > "$2"; fi
  shift
done
exit 3
"""


def run_gpu_script(tmp_path, *steps, deadline=None, prebuilt=None):
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON % sys.executable)
    stub.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(stub),
               LOWFP_GPU_WHEELS=str(tmp_path / "no-wheels"),
               LOWFP_GPU_PREBUILT=str(prebuilt or tmp_path / "no-prebuilt"))
    if deadline is not None:
        env["LOWFP_GPU_DEADLINE"] = str(deadline)
    r = subprocess.run(["bash", "bench/run_gpu.sh", *steps], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, tmp_path / "out"


def test_the_gpu_script_names_at_most_eight_files():
    script = (ROOT / "bench" / "run_gpu.sh").read_text()
    assert subprocess.run(["bash", "-n", "bench/run_gpu.sh"], cwd=ROOT).returncode == 0
    assert set(re.findall(r"starts (\w+) \d+", script)) == set(PARTS)  # a log and a JSON each
    named = {f"{part}.{kind}" for part in PARTS for kind in ("log", "json")}
    assert set(re.findall(r'"\$OUT/([\w.$]+)"', script)) <= {"$1.log", "$part.log", "$1.json"} | named


def test_the_gpu_script_runs_each_part_into_one_log_and_one_json(tmp_path):
    r, out = run_gpu_script(tmp_path, "kernels", "optim", "emulate")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        f"{part}.{kind}" for part in ("emulate", "kernels", "optim") for kind in ("json", "log")]
    log = (out / "kernels.log").read_text()
    for name in ("quantize", "scaled", "s2fp8", "accumulate", "accumulate-narrow", "host"):
        assert f"-- {name}: " in log
    assert "benchmark bench/bench_scaled.py --device cuda" in log and "exit status 3" in log
    # the benchmarks that write JSON, merged under their names
    assert sorted(json.loads((out / "kernels.json").read_text())) == [
        "accumulate", "accumulate_narrow", "quantize", "s2fp8", "scaled"]
    assert sorted(json.loads((out / "emulate.json").read_text())) == ["eager", "gemms"]


def test_the_gpu_script_skips_what_the_deadline_leaves_no_time_for(tmp_path):
    r, out = run_gpu_script(tmp_path, "kernels", "optim", deadline=45)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels: skipped" in (out / "kernels.log").read_text()  # it needs 60 s
    assert "optim: started" in (out / "optim.log").read_text()  # it needs 30
    assert json.loads((out / "optim.json").read_text()) == {"optim": {"by": "stub"}}


def test_the_gpu_script_installs_the_prebuilt_wheel_of_the_same_sources_else_builds(tmp_path):
    """The build step installs bench/prebuild_gpu.sh's wheel where its digest is the working
    tree's (bench/gpu_parts.py sources) and the GPU is sm_90; where the wheel does not import with
    CUDA (here: the stub's import fails), or was built from other sources, it builds."""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    wheel = prebuilt / "lowfp-0.1.0-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(b"")
    for digest, taken in ((gpu_parts.sources(str(ROOT)), True), ("0" * 64, False)):
        (prebuilt / "sources.sha256").write_text(digest + "\n")
        (tmp_path / digest[:4]).mkdir()
        r, out = run_gpu_script(tmp_path / digest[:4], "build", prebuilt=prebuilt)
        log = (out / "suite.log").read_text()
        assert r.returncode == 1, r.stdout + r.stderr  # (the stub's lowfp does not import)
        assert (f"benchmark -m pip install --no-index --no-deps --force-reinstall -q {wheel}" in log) == taken, log
        assert ("did not import with CUDA; building" in log) == taken
        assert ("not taken (built from other sources" in log) == (not taken)
        assert "benchmark -m pip install --no-build-isolation" in log  # (built after all)


def test_build_inputs_digest_follows_every_source_file_and_no_cache(tmp_path):
    """gpu_parts.sources: a change to any build input (its bytes or its name) changes the digest;
    caches and build outputs do not."""
    for name in ("CMakeLists.txt", "pyproject.toml", "cpp/a.hpp", "python/lowfp/b.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    first = gpu_parts.sources(str(tmp_path))
    (tmp_path / "python/lowfp/__pycache__").mkdir()
    (tmp_path / "python/lowfp/__pycache__/b.cpython-312.pyc").write_text("cache")
    (tmp_path / "python/lowfp/_C.so").write_text("built")
    (tmp_path / "README.md").write_text("not read by the build")
    assert gpu_parts.sources(str(tmp_path)) == first
    (tmp_path / "cpp/a.hpp").write_text("changed")
    second = gpu_parts.sources(str(tmp_path))
    assert second != first
    (tmp_path / "cpp/a.hpp").rename(tmp_path / "cpp/c.hpp")
    assert gpu_parts.sources(str(tmp_path)) not in (first, second)


def test_gpu_parts_merges_benchmarks_and_reads_pytests_report(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "b.json").write_text("[2]")
    assert gpu_parts.merge(str(tmp_path)) == {"a": {"x": 1}, "b": [2]}
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n    raise RuntimeError('fixture broke')\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "def test_errs(broken):\n    pass\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped():\n    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--junitxml={xml}", str(tests)], cwd=tmp_path, capture_output=True)
    report = gpu_parts.junit(str(xml))
    assert report["outcome"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    messages = {f["test"].rsplit("::", 1)[1]: f["message"] for f in report["failures"]}
    assert "one is not two" in messages["test_fails"] and "fixture broke" in messages["test_errs"]


def test_the_quantize_gpu_summary_covers_every_target_from_a_runs_rows():
    rows = bench._run_cases("cpu", 4096, 1, bench._once_cpu, allocating=False)
    summary = bench.summarize_gpu(rows)
    assert len(summary) == len(bench.GPU_TARGETS) == 10
    for what, (ratio, target) in summary.items():
        assert math.isfinite(ratio) and ratio > 0 and 0 < target <= 1, what


def test_the_scaled_gpu_summary_covers_every_target_from_a_runs_rows():
    rows = bench_scaled.run(4 * 4096, 1, "cpu")
    summary = bench_scaled.gpu_summary(rows)
    names = [what for what, *_ in summary]
    for name, rounding in bench_scaled.GPU_TARGETS:
        assert f"{name} {rounding} out= / copy" in names
    assert {f"{n} counting cost" for n in bench_scaled.COUNTED} <= set(names)
    # torchao's compiled casts run on a GPU only: their speedups are absent here
    assert not any("compiled" in n for n in names)
    for what, value, target, met in summary:
        assert math.isfinite(value) and met == (value <= target if "counting" in what else value >= target)


def test_the_accumulation_benchmark_prints_issue_58s_targets(capsys):
    import bench_accumulate
    assert bench_accumulate.main(["--size", "4", "64", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    targets = [line for line in out.splitlines() if line.startswith("target: ")]
    assert len(targets) == len(bench_accumulate.PER_ADD) + 1
    assert all(line.endswith(("(met)", "(missed)")) for line in targets)
    assert any(">= 1e+09 products/s" in line for line in targets)  # (the CPU's target)


def test_the_sass_loop_count_skips_the_ranges_that_forward_branches_jump_over():
    import sass_loops
    listing = """
\t\tFunction : _Z6kernelv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/              @!P0 BRA 0x50 ;
        /*0030*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0040*/                   IADD3 R4, R4, 0x2, RZ ;
        /*0050*/                   FADD R5, R5, R2 ;
        /*0060*/               @P1 BRA 0x10 ;
        /*0070*/                   EXIT ;
"""
    (name, instructions), = sass_loops.functions(listing).items()
    assert name == "_Z6kernelv" and len(instructions) == 8
    # the loop 0x10-0x60 holds 6 instructions; its fall-through path skips the two the branch at
    # 0x20 jumps over
    assert sass_loops.loops(instructions) == [(0x10, 0x60, 6, 4)]
    # one pass through the body, the branch at 0x20 falling through, then taken: 6 and 4
    assert sass_loops.path(instructions, 0x10, 0x60) == 6
    assert sass_loops.path(instructions, 0x10, 0x60, taken={0x20: 1}) == 4
    # the loop's own branch taken once: twice through the body, the end at its second pass
    assert sass_loops.path(instructions, 0x10, 0x70, taken={0x60: 1}) == 6 + 6 + 1


def test_emulation_benchmarks_train_a_copy_per_case_inside_its_own_context():
    import bench_emulate
    import torch

    import lowfp
    from lowfp import assign as A

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    before = [p.detach().clone() for p in model.parameters()]
    assignment = A.make(A.trace(model, x, torch.nn.functional.cross_entropy, y), "uniform")
    entered = []

    def emulated(copy, stack):
        entered.append(stack.enter_context(lowfp.emulate(copy, assignment)))
        return copy
    times, firsts = bench_emulate.time_side_by_side(model, x, y, torch.device("cpu"),
                                                    {"plain": None, "emulated": emulated}, 3)
    assert set(times) == set(firsts) == {"plain", "emulated"}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # copies trained
    (em,) = entered
    assert em.step >= 3 and em.model is not model  # its own copy, every step inside the emulation


def test_the_autograd_node_benchmark_times_every_node_against_torch_clone(capsys):
    import bench_autograd
    assert bench_autograd.main(["--no-cpp", "--links", "3", "--rounds", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["torch.clone"][1].strip(" |") == "1.00"
    for name in ("Python Function, Function.apply", "Python Function, torch's C++ apply",
                 "lowfp's emulation rounding, fp(6,9,0)", "lowfp's emulation rounding, float8_e4m3fn"):
        assert float(rows[name][0]) > 0, name
    assert "C++ torch::autograd::Function (libtorch)" not in rows
    assert "could not be built here: --no-cpp" in out


def test_the_python_opcode_count_of_a_step_is_smallest_for_the_plain_step():
    import bench_emulate
    rows = bench_emulate.python_opcodes(steps=1, top=3)
    assert [r["setup"] for r in rows] == ["plain"] + [s for s, _ in bench_emulate.STRATEGIES]
    plain = rows[0]["opcodes_per_step"]
    assert plain > 0 and all(r["opcodes_per_step"] > plain for r in rows[1:])
    assert all(len(r["top"]) == 3 and all(n > 0 for _, n in r["top"]) for r in rows)


def test_the_host_cost_line_counts_roundings_in_place_and_through_lowfps_node():
    import bench_emulate
    import torch
    h = bench_emulate.host_per_rounding(torch.device("cpu"), steps=1)
    # ResNet 8x8 under ours(0.5): 58 forward roundings a step, made in place or through the node
    assert h["in_place_per_step"] > 0 and h["forward_per_step"] > 0
    assert h["in_place_per_step"] + h["forward_per_step"] == 58
    assert h["backward_per_step"] == h["forward_per_step"] and h["forward_cpu_us"] > 0
