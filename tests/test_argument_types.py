"""Every optimizer and format argument fed values of the wrong kind: strings, None, containers,
tensors where none belong, ints where a bool belongs, bools where a number belongs, NaN. Each
call raises a TypeError or ValueError naming the argument before anything runs (the old failure
was pybind11's "Unable to cast Python instance of type str" at the first step()), or, for the
values that torch.optim itself accepts, builds an optimizer that steps."""

import math
import random

import pytest
import torch

import lowfp
from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD

WRONG = ["yes", "", None, [1], (0.5,), {"a": 1}, object(), 1j, torch.ones(2), math.nan]

BOOLS = {ExtraBitsSGD: ("nesterov", "maximize"),
         ExtraBitsAdam: ("amsgrad", "maximize", "decoupled_weight_decay"),
         ExtraBitsAdamW: ("amsgrad", "maximize")}
REALS = {ExtraBitsSGD: ("lr", "momentum", "dampening", "weight_decay"),
         ExtraBitsAdam: ("lr", "eps", "weight_decay"),
         ExtraBitsAdamW: ("lr", "eps", "weight_decay")}
VALID = {ExtraBitsSGD: dict(lr=0.1, momentum=0.9), ExtraBitsAdam: dict(lr=0.1),
         ExtraBitsAdamW: dict(lr=0.1)}


def build(cls, where, name, value):
    """cls with name=value, as a constructor argument or inside a param group."""
    model = torch.nn.Linear(3, 2)
    kwargs = dict(VALID[cls])
    if where == "kwarg":
        kwargs[name] = value
        return cls(model.parameters(), **kwargs), model
    return cls([{"params": model.parameters(), name: value}], **kwargs), model


def step(opt, model):
    model(torch.ones(1, 3, dtype=model.weight.dtype)).sum().backward()
    opt.step()


def expect_refused(cls, where, name, value):
    with pytest.raises((TypeError, ValueError), match=name.split("[")[0]) as err:
        build(cls, where, name, value)
    assert "Unable to cast" not in str(err.value)


@pytest.mark.parametrize("where", ["kwarg", "group"])
@pytest.mark.parametrize("cls", list(BOOLS), ids=lambda c: c.__name__)
def test_flags_take_bools_only(cls, where):
    for name in BOOLS[cls]:
        for value in WRONG + [0, 1, 1.0, "False", torch.tensor(True)]:
            expect_refused(cls, where, name, value)
        for value in (True, False):
            if name == "nesterov" or (name == "decoupled_weight_decay" and where == "group"):
                continue  # nesterov=True needs zero dampening (tested elsewhere)
            opt, model = build(cls, where, name, value)
            step(opt, model)


@pytest.mark.parametrize("where", ["kwarg", "group"])
@pytest.mark.parametrize("cls", list(REALS), ids=lambda c: c.__name__)
def test_hyperparameters_take_real_numbers_only(cls, where):
    for name in REALS[cls]:
        for value in WRONG + [True, False, -1.0, -math.inf]:
            if name == "lr" and isinstance(value, torch.Tensor):
                continue  # a 1-element tensor lr is torch.optim's; a 2-element one is refused below
            expect_refused(cls, where, name, value)
        expect_refused(cls, where, "lr", torch.ones(2))
        if name == "dampening":
            continue
        opt, model = build(cls, where, name, 0.5 if name != "lr" else torch.tensor(0.5))
        step(opt, model)


@pytest.mark.parametrize("cls", [ExtraBitsAdam, ExtraBitsAdamW], ids=lambda c: c.__name__)
def test_betas(cls):
    for value in WRONG + [(0.9,), (0.9, 0.99, 0.5), (0.9, "x"), (True, 0.9), (0.9, math.nan),
                          (1.0, 0.9), (0.9, -0.1), (torch.tensor(0.9), 0.99)]:
        for where in ("kwarg", "group"):
            expect_refused(cls, where, "betas", value)


@pytest.mark.parametrize("cls", list(BOOLS), ids=lambda c: c.__name__)
def test_lowfp_arguments(cls):
    for name, values in (("extra_bits", WRONG + [True, 0, 17, 8.0]),
                         ("rounding", WRONG + [0, "Nearest", "up"]),
                         ("state_dtype", WRONG + [torch.float16, "float32"]),
                         ("param_dtype", WRONG + [torch.float32, "bfloat16"]),
                         ("generator", ["x", 1, torch.ones(1)])):
        for value in values:
            with pytest.raises((TypeError, ValueError), match=name):
                cls(torch.nn.Linear(3, 2).parameters(), **VALID[cls], **{name: value})


FORMAT_ARGS = {"e": 4, "m": 3, "b": 4}


def test_format_arguments_random():
    """Format and fp() with one argument replaced by a wrong value; strings parsed the same way
    name the argument that was wrong, behind quantize's ``fmt``."""
    rng = random.Random(0)
    wrong = ["4", None, 4.0, True, math.nan, [4], 1j, torch.tensor(4)]
    for _ in range(200):
        kwargs = dict(FORMAT_ARGS)
        name = rng.choice(list(FORMAT_ARGS) + ["specials", "subnormals", "overflow"])
        value = rng.choice(wrong + ["ieee", "x", 0, 1, False])
        if name == "overflow" and value is None:
            continue  # None: the convention's default
        kwargs[name] = value
        try:
            f = lowfp.fp(**kwargs)
        except (TypeError, ValueError) as err:
            assert name in str(err), (name, value, err)
            continue
        # accepted: only values that mean what they say
        assert (name == "specials" and value == "ieee") or \
            (name == "subnormals" and type(value) is bool) or \
            (name in FORMAT_ARGS and type(value) is int), (name, value, f)
    for text, arg in (("fp(4.0,3)", "e"), ("fp(True,3)", "e"), ("fp(4,3,None)", "b"),
                      ("fp(4,3,specials=1)", "specials"), ("fp(4,3,subnormals='no')", "subnormals"),
                      ("fp(4,nan,3)", None)):
        with pytest.raises((TypeError, ValueError)) as err:
            lowfp.quantize(torch.ones(2), text)
        assert str(err.value).startswith("fmt"), err.value
        if arg is not None:
            assert arg in str(err.value), err.value


def test_quantize_arguments_random():
    x = torch.ones(4)
    for name, values in (("rounding", WRONG + [0, True]), ("sr_bits", WRONG + [True, 0, 33, 8.0]),
                         ("seed", WRONG + [True, -1, 2**64, 1.5]),
                         ("offset", WRONG + [True, -1, 2**64, 1.5]),
                         ("overflow", WRONG + [0, "clip"]), ("subnormals", WRONG + [0, "yes"]),
                         ("out_dtype", WRONG + [torch.int32, "float32"]),
                         ("stats", WRONG + [1])):
        for value in values:
            if name == "seed" and value is None or name in ("overflow", "subnormals", "out_dtype",
                                                             "stats") and value is None:
                continue  # None is their default
            kwargs = {name: value}
            if name in ("seed", "sr_bits"):
                kwargs["rounding"] = "stochastic"
            with pytest.raises((TypeError, ValueError), match=name):
                lowfp.quantize(x, "fp(4,3,4)", **kwargs)
    with pytest.raises((TypeError, ValueError), match="w16"):
        lowfp.extra_bits.merge(torch.zeros(3), torch.zeros(1, dtype=torch.int32), 8)
    with pytest.raises(TypeError, match="w16"):
        lowfp.extra_bits.merge("w", torch.zeros(1, dtype=torch.int32), 8)
