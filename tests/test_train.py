"""``lowfp train`` end to end with tiny settings."""

import json

import pytest

from lowfp import cli


def run_cli(tmp_path, *args):
    out = tmp_path / "result.json"
    code = cli.main(["train", "--data", "synthetic", "--width", "0.25", "--batch-size", "256",
                     "--quiet", "--json", str(out), *args])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_train_ours_on_synthetic_data(tmp_path, capsys):
    code, res = run_cli(tmp_path, "--epochs", "2", "--assignment", "ours", "--r", "0.6")
    assert code == 0
    assert [e["epoch"] for e in res["epochs"]] == [1, 2]
    assert res["initial_ratio_lo"] >= 0.6 and res["assignment"] == "ours(r=0.6)"
    assert res["best_acc"] == max(e["test_acc"] for e in res["epochs"])
    assert res["epochs"][-1]["step"] == 2 * 4  # 1024 samples / 256 per step, 2 epochs
    assert len(res["history"]["steps"]) == 8 and res["history"]["steps"][0]["loss"] > 0
    text = capsys.readouterr().out
    assert "epoch 2: train loss" in text and "best test accuracy" in text


def test_train_extra_bits_in_backward(tmp_path):
    code, res = run_cli(tmp_path, "--epochs", "1", "--model", "mobilenet", "--optimizer",
                        "extrabits-sgd", "--step-in-backward", "--assignment", "uniform",
                        "--hi", "bfloat16", "--lr", "0.05")
    assert code == 0 and not res["diverged"] and res["ratio_lo"] <= res["initial_ratio_lo"]


def test_train_with_a_gemm_recipe(tmp_path, capsys):
    code, res = run_cli(tmp_path, "--epochs", "1", "--model", "transformer", "--assignment", "fp32",
                        "--recipe", "nvfp4")
    assert code == 0 and res["config"]["recipe"] == "nvfp4" and not res["diverged"]
    assert "GEMM operands nvfp4" in capsys.readouterr().out
    # the recipe changes the run: the same seed without it ends elsewhere
    code, plain = run_cli(tmp_path, "--epochs", "1", "--model", "transformer", "--assignment", "fp32")
    assert res["epochs"][0]["train_loss"] != plain["epochs"][0]["train_loss"]
    with pytest.raises(SystemExit):
        cli.main(["train", "--recipe", "mxfp9"])


def test_recipe_changes_and_high_precision_layers(tmp_path, capsys):
    # --recipe-changes replaces the recipe's fields; --high-precision keeps the last linear
    # layers (here the head) out of it, which the GEMM table shows
    import torch
    from dataclasses import replace
    from lowfp.experiments import models, train
    from lowfp.scaled import RECIPES
    cfg = train.TrainConfig(model="transformer", data="synthetic", recipe="nvfp4",
                            recipe_changes="grad_rounding='nearest', hadamard_seed=None")
    assert train.gemm_recipe(cfg) == replace(RECIPES["nvfp4"], grad_rounding="nearest", hadamard_seed=None)
    model = models.build("transformer", 3, 10, 0.25, 32)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    mapping = train.gemm_recipe(replace(cfg, high_precision=0.15), model)
    assert list(mapping) == [linears[-1], "*"] and mapping[linears[-1]] is None
    assert mapping["*"] == train.gemm_recipe(cfg)
    code, res = run_cli(tmp_path, "--epochs", "1", "--model", "transformer", "--assignment", "fp32",
                        "--recipe", "nvfp4", "--high-precision", "0.15", "--recipe-changes",
                        "weight='nvfp4'")
    assert code == 0 and not res["diverged"]
    assert "GEMM operands nvfp4 (weight='nvfp4'), the last 15% of linear layers unrounded" in capsys.readouterr().out
    for changes, error in (("grad_rounding='up', 3", "keyword arguments"), ("colour='red'", "colour"),
                           ("weight=nvfp4", "literals"), ("weight='nvfp9'", "nvfp9")):
        with pytest.raises(ValueError, match=error):
            train.check_config(replace(cfg, recipe_changes=changes))
    for bad, error in ((dict(recipe="none", recipe_changes="grad_rounding='up'"), "needs a recipe"),
                       (dict(high_precision=1.5), "between 0 and 1"),
                       (dict(recipe="none", recipe_changes="", high_precision=0.2), "needs --recipe")):
        with pytest.raises(ValueError, match=error):
            train.check_config(replace(cfg, **bad))


def test_train_with_an_accumulation(tmp_path, capsys):
    # --accumulate (a preset or an Accumulate's text) on the GEMMs --accumulate-gemms names: a
    # 3-significant-bit weight-gradient sum changes the run; the same with torch's float32 does not
    acc = "Accumulate(\"fp(8,2,0,specials='ieee')\")"
    common = ("--epochs", "1", "--model", "transformer", "--assignment", "fp32", "--accumulate-gemms", "wgrad")
    code, res = run_cli(tmp_path, *common, "--accumulate", acc)
    assert code == 0 and res["config"]["accumulate"] == acc and not res["diverged"]
    assert f"wgrad GEMMs summed as {acc}" in capsys.readouterr().out
    _, plain = run_cli(tmp_path, "--epochs", "1", "--model", "transformer", "--assignment", "fp32")
    _, same = run_cli(tmp_path, *common, "--accumulate", "Accumulate('float32')")
    assert res["epochs"][0]["train_loss"] != plain["epochs"][0]["train_loss"]
    assert same["epochs"][0]["train_loss"] == plain["epochs"][0]["train_loss"]
    code, _ = run_cli(tmp_path, "--accumulate", "hopper-fp8", "--accumulate-gemms", "wgrad,bprop")
    assert code == 2 and "accumulate_gemms must be a comma-separated subset" in capsys.readouterr().err
    code, _ = run_cli(tmp_path, "--accumulate", "hopper")
    assert code == 2 and "cannot parse accumulation 'hopper'" in capsys.readouterr().err


def test_train_rejects_bad_options(tmp_path, capsys):
    code, res = run_cli(tmp_path, "--step-in-backward")
    assert code == 2 and res is None
    assert "step_in_backward needs an extrabits optimizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", "vgg"])


@pytest.mark.parametrize("optimizer", ["extrabits-sgd", "extrabits-adamw"])
def test_extra_bits_optimizers_keep_the_float32_initialisation(optimizer):
    """The model is built in float32 and the optimizer converts it, so its extra bits hold the
    initial weights' cut-off bits (k=16: all of them); BatchNorm's buffers follow to bfloat16."""
    import torch
    from lowfp.experiments import models, train
    cfg = train.TrainConfig(optimizer=optimizer, extra_bits=16, rounding="toward_zero")
    model = models.build("resnet", 1, 10, 0.25, 8)
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = train.make_optimizer(cfg, model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.dtype == torch.bfloat16 for b in model.buffers() if b.is_floating_point())
    assert any(not torch.equal(p.float(), w) for p, w in zip(model.parameters(), w32))
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))
    model(torch.randn(2, 1, 8, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()


def test_train_a_character_model_on_the_standard_library(tmp_path):
    out = tmp_path / "r.json"
    code = cli.main(["train", "--model", "gpt", "--data", "pysource", "--width", "0.25",
                     "--epochs", "1", "--batch-size", "512", "--assignment", "uniform",
                     "--optimizer", "adamw", "--lr", "3e-3", "--quiet", "--json", str(out)])
    res = json.loads(out.read_text())
    assert code == 0 and not res["diverged"]
    e = res["epochs"][0]
    assert 0 < e["test_acc"] < 1 and 0 < e["test_loss"] < 5 and res["final_loss"] == e["test_loss"]
    # a model and data of different kinds are refused
    assert cli.main(["train", "--model", "gpt", "--data", "synthetic", "--quiet"]) == 2
    assert cli.main(["train", "--model", "resnet", "--data", "pysource", "--quiet"]) == 2
