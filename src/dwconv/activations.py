"""The activations dwconv applies in its forward kernels' epilogue (an output is activated in the
accumulator's precision, then rounded and stored once): their names, PyTorch's function for each
(the reference, and what computes them where a gradient is needed), and the modules that are one."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch.nn as nn

# (activation_code: checks a name)
from ._geometry import ACTIVATION_CODES, ACTIVATION_FUNCTIONS, activation_code  # noqa: F401

FUNCTIONS: Dict[str, Callable] = ACTIVATION_FUNCTIONS  # (defined beside the codes: the dispatcher reads them too)


def activation_of(module: nn.Module) -> Optional[str]:
    """The name of the activation a module computes, or None where it is none of them (a subclass
    is not trusted: it may compute something else)."""
    kind = type(module)
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if kind is nn.Hardtanh and (module.min_val, module.max_val) == (0.0, 6.0):
        return "relu6"
    return {nn.Identity: "identity", nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Hardswish: "hardswish",
            nn.Hardsigmoid: "hardsigmoid"}.get(kind)
