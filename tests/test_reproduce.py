"""``lowfp reproduce``: the verdict logic on synthetic results (it can say each of its three
words), every experiment end to end on a tiny configuration, resuming, and bad options."""

import functools
import math
import os
from dataclasses import replace

import pytest

from lowfp import cli
from lowfp.experiments import data
from lowfp.experiments import reproduce as R


def stats(*losses, diverged=0):  # without seeds: compared by their means and spreads
    return R.ArmStats(list(losses), [0.5] * len(losses), 0.0, diverged)


def test_arms_with_common_seeds_are_compared_seed_by_seed():
    a = R.ArmStats([2.00, 2.10, 2.05], [0.5] * 3, 0.0, 0, [0, 1, 2])
    b = R.ArmStats([2.02, 2.12, 2.07], [0.5] * 3, 0.0, 0, [0, 1, 2])
    claim = R.Claim("a beats b", "better", "a", "b")
    # spreads of 0.1 hide a difference of 0.02 between the means, but every seed shows it
    assert R.verdict(claim, stats(*a.losses), stats(*b.losses))[0] == "inconclusive"
    word, detail = R.verdict(claim, a, b)
    assert word == "reproduced" and "per seed -0.0200" in detail
    b.losses = [2.02, 2.08, 2.07]  # one seed the other way: the differences spread over 0.04
    assert R.verdict(claim, a, b)[0] == "inconclusive"


@pytest.mark.parametrize("kind,a,b,want", [
    ("better", stats(2.00, 2.01), stats(2.10, 2.11), "reproduced"),
    ("better", stats(2.10, 2.11), stats(2.00, 2.01), "not reproduced"),
    ("better", stats(2.00, 2.04), stats(2.03, 2.05), "inconclusive"),  # within twice the spread
    ("better", stats(2.0), stats(math.inf, diverged=1), "reproduced"),
    ("close", stats(2.03, 2.04), stats(2.00, 2.01), "reproduced"),     # within 2 %
    ("close", stats(2.20, 2.21), stats(2.00, 2.01), "not reproduced"),
    ("close", stats(math.inf, diverged=1), stats(2.0), "not reproduced"),
    ("fails", stats(3.00, 3.10), stats(2.00, 2.01), "reproduced"),
    ("fails", stats(math.inf, 3.0, diverged=1), stats(2.00), "reproduced"),
    ("fails", stats(2.00, 2.01), stats(2.00, 2.01), "not reproduced"),
    ("fails", stats(2.10, 2.11), stats(2.00, 2.01), "inconclusive"),   # worse, not failed
])
def test_verdicts_on_synthetic_results(kind, a, b, want):
    got, detail = R.verdict(R.Claim("claim", kind, "a", "b"), a, b)
    assert got == want, detail
    assert "a " in detail and "b " in detail


def test_verdicts_of_nothing_and_of_a_bad_kind():
    assert R.verdict(R.Claim("c", "better", "a", "b"), stats(), stats(1.0))[0] == "inconclusive"
    assert R.verdict(R.Claim("c", "better", "a", "b"), stats(math.inf, diverged=1),
                     stats(math.inf, diverged=1))[0] == "inconclusive"
    with pytest.raises(ValueError, match="kind"):
        R.verdict(R.Claim("c", "worse", "a", "b"), stats(1.0), stats(1.0))


@pytest.mark.long
def test_every_experiment_end_to_end_and_resumed(tmp_path, monkeypatch):
    # An eighth of the pysource text (CI time); the claims checked below hold on it as well.
    small = functools.partial(data._pysource, chars=data.PYSOURCE_CHARS // 8)
    monkeypatch.setattr(data, "_pysource", small)
    base = replace(R.BASE, width=0.25, epochs=1)
    lines = []
    out = str(tmp_path / "rep")
    res = R.run_reproduce(list(R.EXPERIMENTS), base, out, seeds=[0], jobs=1, log=lines.append)
    report = open(res["report"]).read()
    for key, exp in R.EXPERIMENTS.items():
        assert exp.title in report
        assert len(res["verdicts"][key]) == len(exp.claims) + (2 if exp.gemm_errors else 0)
        for claim, word, _ in res["verdicts"][key]:
            assert word in ("reproduced", "not reproduced", "inconclusive")
            assert f"{claim.text}: **{word}**" in report
        assert os.path.exists(os.path.join(out, f"{key}.png"))
    # the float32 baseline is one run shared by the experiments that use it
    fp32 = [res["runs"][k]["fp32"][0]["config"] for k in ("s2fp8", "extrabits")]
    assert fp32[0] == fp32[1]
    # at op's ratio: ours's initial low-precision ratio is at least op's
    runs = res["runs"]["assignment"]
    assert runs["ours"][0]["initial_ratio_lo"] >= runs["op"][0]["initial_ratio_lo"] - 1e-3
    # e5m2 without loss scaling trains far worse than float32 even in one epoch
    e5m2 = dict((c.a, w) for c, w, _ in res["verdicts"]["s2fp8"])["e5m2"]
    assert e5m2 == "reproduced"
    # the MPT section shows the float32 run's gradients against float16's range
    assert os.path.exists(os.path.join(out, "mpt-gradients.png"))
    hist = R.gradient_exponents(res["runs"]["mpt"]["fp32"])
    share = R.share_below(hist, -25)
    assert f"{100 * share:.1f} % lie below 2^-25, half float16's smallest subnormal" in report
    assert 0 < sum(hist[1]) and 0 < share < 1
    # the NVFP4 experiment: its recipe keeps the last linear layer (the head) out, its ablations
    # change one field each, and its float32 run is the accumulation experiment's
    nv = res["runs"]["nvfp4"]
    assert (nv["nvfp4"][0]["config"]["high_precision"], nv["all-nvfp4"][0]["config"]["high_precision"]) == (0.15, 0.0)
    assert nv["no-hadamard"][0]["config"]["recipe_changes"] == "hadamard_seed=None"
    assert nv["fp32"][0]["config"] == res["runs"]["accumulation"]["fp32"][0]["config"]
    # the accumulation experiment: half the width, half the epochs (at least one), and
    # its GEMM measurements in the verdicts and the report
    short = res["runs"]["accumulation"]["short"][0]["config"]
    assert (short["width"], short["epochs"], short["accumulate_gemms"]) == (0.125, 1, "wgrad")
    measured = [(c.text, w) for c, w, _ in res["verdicts"]["accumulation"] if c.kind == "measured"]
    assert [w for _, w in measured] == ["reproduced", "reproduced"]
    assert "| positive | Hopper FP8 tensor cores (one accumulator) |" in report
    assert os.path.exists(os.path.join(out, "accumulation-gemm.png"))
    lines.clear()
    R.run_reproduce(["s2fp8"], base, out, seeds=[0], jobs=1, log=lines.append)
    assert "3 runs (3 already in" in lines[0]  # resumed: nothing trained again
    assert not any(line.startswith("[") for line in lines)


def test_the_nvfp4_experiments_arms_are_the_reports_ablations():
    # planned, not trained (the long test trains them): each ablation changes one thing of the
    # recipe, and every config passes lowfp train's checks
    from lowfp.experiments import train
    from lowfp.scaled import RECIPES
    grid = R.plan(["nvfp4"], R.BASE, [0])["nvfp4"]
    cfg = {arm: cs[0] for arm, cs in grid.items()}
    for c in cfg.values():
        train.check_config(c)
    full = train.gemm_recipe(cfg["nvfp4"])
    assert full == RECIPES["nvfp4"] and cfg["nvfp4"].high_precision == 0.15
    assert train.gemm_recipe(cfg["no-hadamard"]).hadamard_seed is None
    assert train.gemm_recipe(cfg["nearest-grads"]).grad_rounding == "nearest"
    assert train.gemm_recipe(cfg["1x16-weights"]).weight == RECIPES["nvfp4"].input
    assert cfg["all-nvfp4"].high_precision == 0 and cfg["all-nvfp4"].recipe == "nvfp4"
    assert train.gemm_recipe(cfg["mxfp8-rceil"]).input.scale_rule == "rceil"
    assert train.gemm_recipe(cfg["mxfp8-floor"]).input.scale_rule == "floor"
    assert (cfg["fp32"].epochs, cfg["fp32"].width) == (1, 0.25)


def test_accumulation_claims_are_measured_on_gemms(tmp_path):
    # the accumulation experiment's GEMM half (its training half is lowfp train --accumulate):
    # errors by K against the exact sum, the two verdicts, the report's table and figure
    from lowfp.experiments import accumulation
    e = accumulation.gemm_errors(ks=(256, 4096))
    hopper, promoted = e.errors["positive"]["hopper-fp8"], e.errors["positive"]["deepseek-v3"]
    assert hopper[4096][0] > hopper[256][0] > promoted[4096][0] > e.errors["positive"]["float32"][4096][0]
    assert [v for _, v, _ in accumulation.claims(e)] == ["reproduced", "reproduced"]
    lines = accumulation.section(str(tmp_path), e)
    assert "| positive | Hopper FP8 tensor cores (one accumulator) |" in "\n".join(lines)
    assert (tmp_path / "accumulation-gemm.png").exists()


def test_bad_options(tmp_path, capsys):
    assert cli.main(["reproduce", "s2fp9", "--out", str(tmp_path)]) == 2
    assert "unknown experiment 's2fp9'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert cli.main(["reproduce", "--data", "synthetic", "--model", "gpt", "--epochs", "1",
                     "--out", str(tmp_path)]) == 2
    assert "model gpt trains on character windows" in capsys.readouterr().err


def test_gradient_exponents_against_frexp():
    import torch
    from lowfp.experiments.train import GradientExponents
    g = torch.tensor([0.0, 1.0, -0.75, 2.0 ** -24, -(2.0 ** -25) * 1.5, 3e-30, 1e6, float("inf"),
                      0.0, 2.0 ** -14])
    h = GradientExponents()
    h._add(g, 4.0)  # divided by the loss scale 4
    low = h.LOW
    want = [0] * len(h.counts)
    for v in g.tolist():
        if v != 0 and math.isfinite(v):
            e = math.frexp(abs(v) / 4)[1] - 1  # 2^e <= |v|/4 < 2^(e+1)
            want[min(max(e - low, 0), len(want) - 1)] += 1
    assert h.counts == want and h.zeros == 2
    hist = (low, h.counts, h.zeros)
    # below 2^-24: 2^-26, 1.5·2^-27 and 3e-30/4 (of 7 finite nonzero values)
    assert R.share_below(hist, -24) == pytest.approx(3 / 7)
    assert R.share_below(hist, -24, shift=3) == pytest.approx(1 / 7)


def test_reproduce_on_cifar_files(tmp_path):
    # the image path (the papers' ResNet-18 on CIFAR-10 from --data-dir), on generated files
    from test_data import write_cifar
    write_cifar(str(tmp_path / "cifar"), 10)
    out = tmp_path / "rep"
    assert cli.main(["reproduce", "s2fp8", "--data", "cifar10", "--data-dir", str(tmp_path / "cifar"),
                     "--epochs", "1", "--seeds", "1", "--width", "0.125", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "Base run: resnet18 (width 0.125) on cifar10" in report
    assert "S2FP8 reaches float32: **" in report
