"""Optimizers that keep 16-bit weights plus k packed extra bits instead of an fp32 master copy
(docs/design.md §5): ``ExtraBitsSGD``, ``ExtraBitsAdam``, ``ExtraBitsAdamW``.

>>> import torch, lowfp
>>> model = torch.nn.Linear(4, 2)                       # float32 parameters ...
>>> opt = lowfp.optim.ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16)
>>> model.weight.dtype                                  # ... now bfloat16 + 16 extra bits
torch.bfloat16

Each step merges w and its extra bits into W' (float32), applies torch.optim's update formula in
float32 with torch's own arithmetic (the same operations and fused multiply-adds as torch's CPU
kernels, and for Adam torch's own square root: see _torch_sqrt), and splits the result back, in
one fused pass over every element of a parameter group.
Arguments, defaults, param groups, LR schedulers, ``zero_grad`` and ``state_dict`` work as in
torch.optim. float32 parameters are converted to ``param_dtype`` in place when the optimizer is
built, their cut-off bits becoming the initial extra bits (so nothing is lost with bfloat16 and
k=16); the model then computes in that dtype. Buffers are not parameters: a model with float32
buffers (BatchNorm's running statistics) needs ``model.to(param_dtype)`` after the optimizer is
built, which leaves the already 16-bit parameters and their extra bits as they are.
float16/bfloat16 parameters start with zero extra bits.
Parameters may have any dense layout (channels_last, transposed): a step goes over their elements
in memory order, the order their extra bits and moments are kept in.
"""

from .adam import ExtraBitsAdam, ExtraBitsAdamW
from .sgd import ExtraBitsSGD
from .states import LowPrecisionStates, low_precision_states
from .step_in_backward import StepInBackward, step_in_backward

__all__ = ["ExtraBitsSGD", "ExtraBitsAdam", "ExtraBitsAdamW", "step_in_backward", "StepInBackward",
           "low_precision_states", "LowPrecisionStates"]
