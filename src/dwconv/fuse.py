"""The fused depthwise block: `convert(model, fuse=True)` finds each converted depthwise layer
followed by a BatchNorm2d and/or an activation, and the layer computes all three; the BatchNorm and
activation modules then pass their input through. With the BatchNorm in eval mode, in one pass: the
BatchNorm folded into the layer's weight and bias, the activation in the kernel's epilogue (no
gradient wanted) or PyTorch's function after it (one wanted). In training mode, the convolution
and then BatchNorm (the batch's statistics, the running ones updated) with the activation in two
passes forward and two backward (dwconv.batch_norm). Every other BatchNorm2d of the model (after a
pointwise convolution, before a residual add) makes a trained block with the nn.Conv2d before it and
the activation module after it: in training the BatchNorm computes both on the same kernels and the
activation module passes its input through; in eval mode the BatchNorm is folded into the
convolution's weight and bias and the convolution applies the activation after it (PyTorch's
convolution or a matrix product, then the activation; not under torch.compile, where Inductor fuses
the BatchNorm and the activation into its next kernel), unless a fused depthwise layer alone reads
it (an inverted residual's expansion): that layer then applies the BatchNorm and the activation to
its input as it loads it, and the convolution folds nothing
(`find_input_activations`, `_input_link`). A fused eval call that nothing differentiates is one
registered op, `dwconv::conv2d_block` (the tile kernels apply the BatchNorm to their sums; the other
families' folding is a launch of the op's own program); so is a trained block's
1x1 convolution of a channels_last half-precision input, folding, product and activation (ReLU in
the product's epilogue: `dwconv::pointwise_folded`), and, eager, the product alone of such an
expansion whose BatchNorm the depthwise layer applies (the same op without a BatchNorm).

Nothing is replaced: the three modules keep their identity, parameters, buffers and state_dict
keys; only their classes change (FusedDepthwiseConv2d, and subclasses of the norm's and the
activation's own classes: `folded_class`). A block is fused only where it is proven to be one: the layer's
output goes to the BatchNorm and nowhere else, the BatchNorm's to the activation (torch.fx traces of
the parent module's forward, in training and in eval mode, with its children as leaves), each module
is used once in the model and has no hooks, and the BatchNorm keeps running statistics.
"""

from __future__ import annotations

import collections
import functools
from typing import Dict, List, Optional, Tuple

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
import torch.nn.functional as F

from . import functional, precompile, squeeze_excite
from ._library import pointwise_product
from ._geometry import ACTIVATION_CODES, INPUT_ACTIVATIONS, forward_activation_code, op_arguments
from .batch_norm import batch_norm_activation, compiled_batch_norm_activation
from .kernels import batch_norm as batch_norm_kernels
from .kernels import squeeze_excite as squeeze_excite_kernels
from .batch_norm import reference as batch_norm_reference
from .activations import FUNCTIONS, activation_of
from .functional import _gradient_wanted, depthwise_conv2d
from .kernels._launch import PLAIN_TENSORS
from .modules import DepthwiseConv2d
from .replay.native import replayed
from .block_replay import BlockPrograms, ReplayedBlock, find_replayed_blocks

# a block: the layer, its BatchNorm2d, its activation module, the activation's name, and where the
# modules are ((owner, attribute name, module): a block whose module another replaced is no longer one)
Block = Tuple[DepthwiseConv2d, Optional[nn.BatchNorm2d], Optional[nn.Module], str, tuple]


# ---- the modules of a fused block --------------------------------------------------------------

class FusedDepthwiseConv2d(DepthwiseConv2d):
    """A DepthwiseConv2d computing the BatchNorm2d after it (`dwconv_norm`, or None) and the
    activation after that (`dwconv_activation`, a name of dwconv.activations.FUNCTIONS) wherever
    its block (`dwconv_block`: this layer, the BatchNorm, the activation module) is fused at the
    call (`fused_now`)."""

    @property
    def dwconv_norm(self) -> Optional[nn.BatchNorm2d]:
        return self.dwconv_block[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        if not fused_now(self.dwconv_block):
            return super().forward(input)  # (the block as it was: the BatchNorm and activation run)
        link = _input_link(self, conv_fused=True)
        norm = self.dwconv_norm
        if norm is not None and norm.training:
            return _normalized_in_training(self, super().forward(_linked_input(input, link)))
        tensors = tensors_of(self, norm) + (() if link is None else _norm_tensors(link[1]))
        if _block_op_computes(input, tensors):  # (nothing differentiated: one op, the foldings inside it)
            return _block_op(self, norm, link, _autocast_input(input), tensors)
        if precompile._TRACING.__dict__.get("active") and not _gradient_wanted(input, *tensors):
            # (a warmup's fake run: the op's kernels compile; PyTorch's ops give the fake output)
            precompile.record_block(_autocast_input(input), *tensors[:2], norm, None if link is None else link[1],
                                    self.dwconv_op_arguments, _op_activation_code(self, link))
            weight, bias = (self.weight, self.bias) if norm is None else fold_batch_norm(self.weight, self.bias, norm)
            out = F.conv2d(_linked_input(input, link), weight, bias, self.stride, self.padding, self.dilation,
                           self.groups)
            return FUNCTIONS[self.dwconv_activation](out)
        weight, bias = (self.weight, self.bias) if norm is None else fold_batch_norm(self.weight, self.bias, norm)
        activation = None if self.dwconv_activation == "identity" else self.dwconv_activation
        return depthwise_conv2d(_linked_input(input, link), weight, bias, self.stride, self.padding,
                                self.dilation, activation)

    @property
    def dwconv_op_arguments(self) -> tuple:
        """(stride, padding [top, bottom, left, right], dilation) as the registered ops take them."""
        key = (self.kernel_size, self.stride, self.padding, self.dilation)
        kept = self.__dict__.get("_dwconv_op_arguments")
        if kept is None or kept[0] != key:
            kept = self.__dict__["_dwconv_op_arguments"] = (key, op_arguments(*key))
        return kept[1]

    def extra_repr(self) -> str:
        fused = ([f"norm={type(self.dwconv_norm).__mro__[2].__name__}"] if self.dwconv_norm is not None
                 else []) + [f"activation={self.dwconv_activation!r}"]
        return super().extra_repr() + ", fused: " + ", ".join(fused)


class _PassedThrough:
    """The BatchNorm2d or the activation module of a fused block (`folded_class`): where the block is
    fused at the call its input passes through (its layer computed it: the BatchNorm folded into its
    weight and bias, the activation in its kernel, timm's BatchNormAct2d's own activation too);
    otherwise it runs as its own class did."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        if fused_now(self.dwconv_block):
            return input
        return super().forward(input)

    def extra_repr(self) -> str:
        return "computed by its depthwise layer" + (", " + super().extra_repr() if super().extra_repr() else "")


def fused_now(block: tuple) -> bool:
    """Whether a block (its layer, BatchNorm2d or None, activation module or None, where they are)
    computes as one at this call (the layer computes it, in the BatchNorm's mode): each module still
    where it was found (a tool that swaps a module for another, as convert_sync_batchnorm or timm's
    freeze_batch_norm_2d do, leaves the old one behind: the new one computes, not the old), and no
    hook, on its modules or on every module, that would see a value inside it (the layer's or the
    BatchNorm's output, which the fused call never makes), and no parametrization (torch.nn.utils.
    parametrize, as weight_norm and spectral_norm are now: the fused calls read the modules' own
    parameters). Each of the three modules asks at each
    call and gets the same answer: no state passes between them (threads, re-entrant calls)."""
    return _holds(block[3]) and _unhooked(block[:3])


def _unhooked(modules: tuple) -> bool:
    """Whether no hook, on these modules (None: none) or on every module, and no parametrization of
    theirs would see or change a value inside a fused call (fused_now)."""
    hooks = _MODULE_GLOBALS
    if hooks["_global_forward_hooks"] or hooks["_global_forward_pre_hooks"] or hooks["_global_backward_hooks"] \
            or hooks.get("_global_backward_pre_hooks"):
        return False
    for m in modules:
        if m is not None:
            state = m.__dict__  # (not through the class's attribute lookup: a few hundred calls a forward)
            if state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"] \
                    or state["_backward_pre_hooks"] or "parametrizations" in state["_modules"]:
                return False
    return True


_MODULE_GLOBALS = vars(nn.modules.module)  # (the global hooks' dicts, which PyTorch's register functions fill)


def input_activation_now(conv: "FusedDepthwiseConv2d") -> Optional[str]:
    """_input_link's activation, or None."""
    link = _input_link(conv)
    return None if link is None else link[0]


def _input_link(conv: "FusedDepthwiseConv2d", before_fused: bool = False, conv_fused: bool = False
                ) -> Optional[Tuple[str, nn.BatchNorm2d]]:
    """(the activation, the BatchNorm2d) of the layer before that this depthwise layer applies to its
    input at this call, or None. Where a trained block's activation (`find_input_activations`: its
    BatchNorm in eval mode) feeds this layer alone, the layer applies that BatchNorm and activation
    as it loads its input, and the block's modules pass their input through (its convolution
    computes without the BatchNorm folded in; timm's BatchNormAct2d passes its input through too):
    no pass over the widest tensor of an inverted residual block, and no folding before it. All ask
    this at each call and get the same answer: both blocks fused at the call, the BatchNorm before
    in eval mode, the modules between where they were found and without hooks (a hook there would
    see the value before its activation). before_fused, conv_fused: the caller has just found that
    block fused_now at this call."""
    link = conv.__dict__.get("dwconv_input")
    if link is None:
        return None
    before, activation, between = link
    if before[1].training or not (before_fused or fused_now(before)) \
            or not (conv_fused or fused_now(conv.dwconv_block)) or not _holds(between):
        return None
    for _, _, module in between:
        if _hooked(module):
            return None
    return activation, before[1]


def _linked_input(input: torch.Tensor, link: Optional[Tuple[str, nn.BatchNorm2d]]) -> torch.Tensor:
    """The input with the layer before's BatchNorm (eval mode) and activation applied (_input_link),
    by PyTorch's functions (differentiable)."""
    if link is None:
        return input
    activation, norm = link
    normalized = F.batch_norm(input, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)
    return FUNCTIONS[activation](normalized)


def _block_op_computes(input: torch.Tensor, tensors: tuple) -> bool:
    """Whether the registered block op computes this eval call (_block_op): nothing differentiated
    (autograd of either mode), tensors the kernels read as they are (not torch.func's wrappers, not
    subclasses that dispatch in Python, nor a warmup's fake ones), all on the input's device, the
    BatchNorms' floating, and a computation in the dtype of the input after autocast's cast (else
    PyTorch's path raises as stock does). Under torch.compile and torch.jit.trace, the op in the graph."""
    if not functional.uses_triton(input) or _gradient_wanted(input, *tensors):
        return False
    compiling = torch.compiler.is_compiling()
    if not compiling and (type(input) is not torch.Tensor or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    device = input.device
    for position, t in enumerate(tensors):
        if t is None:
            continue
        if not compiling and (type(t) not in PLAIN_TENSORS or t.device != device):
            return False
        if position >= 2 and not t.is_floating_point():
            return False
    return _compute_dtype(input, input) == _compute_dtype(input, tensors[0])


def _autocast_input(input: torch.Tensor) -> torch.Tensor:
    """The input as autocast casts F.conv2d's."""
    dtype = _compute_dtype(input, input)
    return input if input.dtype == dtype else input.to(dtype)


def _op_activation_code(conv: "FusedDepthwiseConv2d", link: Optional[Tuple[str, nn.BatchNorm2d]]) -> int:
    return forward_activation_code((link[0], conv.dwconv_activation) if link is not None else conv.dwconv_activation)


def _block_op(conv: "FusedDepthwiseConv2d", norm: Optional[nn.BatchNorm2d],
              link: Optional[Tuple[str, nn.BatchNorm2d]], input: torch.Tensor, tensors: tuple) -> torch.Tensor:
    """torch.ops.dwconv.conv2d_block of the block's tensors (tensors_of the layer and its BatchNorm,
    then of the BatchNorm before where the input is linked)."""
    weight, bias = tensors[:2]
    norm_tensors = tensors[2:6] if norm is not None else (None,) * 4
    input_tensors = tensors[-4:] if link is not None else (None,) * 4
    return torch.ops.dwconv.conv2d_block.default(
        input, weight, bias, *norm_tensors, norm.eps if norm is not None else 0.0,
        *input_tensors, link[1].eps if link is not None else 0.0, *conv.dwconv_op_arguments,
        _op_activation_code(conv, link))


def _folds_now(block: tuple) -> bool:
    """Whether a trained block (with a convolution, its BatchNorm in eval mode, found fused_now at the call)
    folds its BatchNorm into its convolution at this call: not where the depthwise layer after applies
    it (_input_link), nor under torch.compile, where the folding would be kernels of the graph's own
    at every call and Inductor fuses the BatchNorm into the pointwise kernel after it instead (a
    residual add, an activation), as it does stock's (docs/decisions.md, "The BatchNorm before a
    depthwise layer applied as its input loads")."""
    conv, norm, activation_module, _ = block
    # (compiling asked first: a compiled graph then reads nothing of the link, whose every read is a guard)
    return not torch.compiler.is_compiling() and \
        not _applied_after(activation_module if activation_module is not None else norm, True)


def _applied_after(module: nn.Module, before_fused: bool = False) -> bool:
    """Whether the depthwise layer after this activation (or BatchNormAct2d) applies it, and the
    BatchNorm before it, at this call (_input_link; before_fused: the caller has just found the
    module's block fused_now)."""
    after = module.__dict__.get("dwconv_applied_by")
    return after is not None and _input_link(after, before_fused) is not None


def _holds(places: tuple) -> bool:
    """Whether each (owner, name, module) is still where it was found."""
    for owner, name, member in places:
        if owner._modules.get(name) is not member:
            return False
    return True


class _TrainedNorm:
    """The BatchNorm2d of a trained block (no depthwise layer before it: `find_norm_blocks`), where its
    block holds at the call: in training, it computes itself and the activation after it on dwconv's
    BatchNorm kernels; in eval mode, where the block has a convolution, it passes its input through
    where the depthwise layer after applies it (and its activation), or where the convolution folded
    it (timm's BatchNormAct2d then applies its own activation); otherwise (torch.compile: Inductor
    fuses it) it runs as its own class does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        conv, _, activation_module, _ = block = self.dwconv_block
        if (self.training or conv is not None) and fused_now(block):
            if self.training:
                return _trained(self, activation_module, self.dwconv_activation, input)
            if _applied_after(activation_module if activation_module is not None else self, True):
                return input  # (the depthwise layer after applies it, and the activation)
            if not torch.compiler.is_compiling():  # (its convolution folded it, and applied the activation)
                return input
        return super().forward(input)

    def extra_repr(self) -> str:
        folded = ", folded into its convolution in eval mode" if self.dwconv_block[0] is not None else ""
        return (f"in training on dwconv's kernels with activation={self.dwconv_activation!r}{folded}, "
                + super().extra_repr())


class _FoldingConv:
    """The nn.Conv2d of a trained block: with the block's BatchNorm in eval mode, where the block holds
    at the call, it computes the BatchNorm too (folded into its weight and bias: one pass over its
    output less); otherwise (in training too: docs/decisions.md, "A trained 1x1 convolution as the
    matrix product") it runs as its own class does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        norm = self.dwconv_block[1]
        if norm.training or not fused_now(self.dwconv_block):
            return super().forward(input)
        if not _folds_now(self.dwconv_block):
            # (the depthwise layer after applies the BatchNorm, or Inductor fuses it into its next kernel)
            return self._conv_or_product(input, self.weight, self.bias)
        # folded: the BatchNorm and the activation after it computed here (they pass their input through)
        tensors = tensors_of(self, norm)
        if _pointwise_op_computes(self, input, tensors):  # (the folding, the product and ReLU: one op)
            return torch.ops.dwconv.pointwise_folded.default(_autocast_input(input), *tensors, norm.eps,
                                                             ACTIVATION_CODES[norm.dwconv_activation])
        return FUNCTIONS[norm.dwconv_activation](self._conv_or_product(input, *_folded_parameters(self, norm, input)))

    def _conv_or_product(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # (the dtype the product computes in, not the weight's: folded in the graph (gradients wanted)
        # or not folded at all, the weight stays float32 and autocast casts it at the call)
        if _compute_dtype(input, weight) in _PRODUCT_DTYPES and _pointwise_rows(self, input):
            if not torch.compiler.is_compiling() and weight is self.weight and _op_computes(input, (weight, bias)):
                # (eager, nothing differentiated: one op call, its views and the weight's cast replayed from C++)
                return torch.ops.dwconv.pointwise_folded.default(_autocast_input(input), weight, bias, None, None,
                                                                 None, None, 0.0, ACTIVATION_CODES["identity"])
            return pointwise_product(input, weight, bias)
        return self._conv_forward(input, weight, bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", the BatchNorm after it folded in eval mode, with its activation"


# (float32 keeps cuDNN's convolution: by torch's defaults it computes in TF32 where a float32 matmul does
# not, so a product would be slower where the layer is compute-bound, with other numerics than stock's)
_PRODUCT_DTYPES = (torch.float16, torch.bfloat16)


def _pointwise_rows(conv: nn.Conv2d, input: torch.Tensor) -> bool:
    """Whether conv of input is a matrix product of the input's rows of channels as they lie: a 1x1
    convolution (stride 1, no padding, one group) of a channels_last input that stock's convolution
    reads as given (padding_mode "zeros": another mode's F.pad copies the input, on CUDA into NCHW,
    and stock's output is then NCHW too). (Not under torch.func's
    transforms: vmap cannot ask a tensor's memory format. torch.compile's tracing answers the
    interpreter stack's question as a transform would, and may ask the format: the product is the
    convolution's value in any layout, the layout only decides which is faster.)"""
    return (_is_pointwise(conv) and input.dim() == 4
            and (torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None)
            and input.is_contiguous(memory_format=torch.channels_last))


def _is_pointwise(conv: nn.Conv2d) -> bool:
    """Whether conv is a 1x1 convolution, stride 1, no padding (a 1x1 "same" has none;
    padding_mode "zeros": another mode's F.pad copies the input), one group."""
    return (conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.groups == 1
            and (conv.padding == (0, 0) or isinstance(conv.padding, str)) and conv.padding_mode == "zeros")


def _pointwise_op_computes(conv: nn.Conv2d, input: torch.Tensor, tensors: tuple) -> bool:
    """Whether dwconv::pointwise_folded computes a trained block's folding eval call: a product in half
    precision of a channels_last input (_pointwise_rows), the block op's conditions on the tensors
    (_block_op_computes: nothing differentiated), and not a warmup's fake run (whose folding
    _folded_parameters records for the compile)."""
    return _compute_dtype(input, input) in _PRODUCT_DTYPES and _pointwise_rows(conv, input) \
        and _op_computes(input, tensors)


def _op_computes(input: torch.Tensor, tensors: tuple) -> bool:
    """_block_op_computes, and not a warmup's fake run."""
    return not precompile._TRACING.__dict__.get("active") and _block_op_computes(input, tensors)


class _TrainedActivation:
    """The activation module of a trained block: its input passes through where the block's
    BatchNorm, in training, computed it; otherwise it runs as its own class did."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        conv, norm, _, _ = block = self.dwconv_block
        if _applied_after(self) or (fused_now(block) and (norm.training or (conv is not None and _folds_now(block)))):
            return input  # (its BatchNorm in training, its convolution folding, or the depthwise layer after)
        return super().forward(input)

    def extra_repr(self) -> str:
        return "computed by its BatchNorm in training" + (", " + super().extra_repr() if super().extra_repr() else "")


# ---- squeeze-and-excitation blocks ---------------------------------------------------------------

# the classes whose forward is known, by module and name (neither library need be installed): the
# names of their reduce convolution, activation, expand convolution, gate, and average pool (None:
# the forward takes the mean itself)
_SQUEEZE_EXCITE_CLASSES = {
    ("torchvision.ops.misc", "SqueezeExcitation"): ("fc1", "activation", "fc2", "scale_activation", "avgpool"),
    ("timm.models._efficientnet_blocks", "SqueezeExcite"): ("conv_reduce", "act1", "conv_expand", "gate", None),
}


class _SqueezeExcite:
    """A squeeze-and-excitation module (_SQUEEZE_EXCITE_CLASSES) whose members are as they were found,
    without hooks (_squeeze_now): in eager where nothing is differentiated, one registered op,
    dwconv::squeeze_excite; where a gradient is wanted, dwconv's kernels in autograd nodes around
    the gate its own members compute (dwconv.squeeze_excite.trained). Otherwise (and
    under torch.compile, whose kernels fuse the block already) it runs as its own class does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):
            return _traced_as_a_call(self, input)
        arguments = _squeeze_now(self)
        if arguments is not None and not torch.compiler.is_compiling():
            if _op_computes(input, arguments[:4]):
                return torch.ops.dwconv.squeeze_excite.default(input, *arguments)
            if _gradient_wanted(input, *arguments[:4]) and not functional.compiled_autograd_on():
                out = squeeze_excite.trained(squeeze_excite.gate_members(self.__dict__["dwconv_squeeze"][0]),
                                             arguments[:4], input)
                if out is not None:
                    return out
            elif precompile._TRACING.__dict__.get("active"):
                precompile.record_squeeze(input, *arguments)  # (a warmup's fake run: the op's kernels compile)
        return super().forward(input)

    def extra_repr(self) -> str:
        return "one op in eager where nothing is differentiated" + (", " + super().extra_repr()
                                                                    if super().extra_repr() else "")


def _squeeze_now(module: nn.Module) -> Optional[tuple]:
    """squeeze_excite's arguments after the input for a found squeeze-and-excitation module at this
    call (its convolutions' weights and biases, the activation's and the gate's codes), or None where
    a member is no longer where it was found or not a 1x1 convolution, or a hook or parametrization
    would see inside the block."""
    places, activation, gate = module.__dict__["dwconv_squeeze"]
    if not _holds(places) or not _unhooked((module,) + tuple(member for _, _, member in places)):
        return None
    reduce, expand = places[0][2], places[2][2]
    if not (_is_plain_pointwise(reduce) and _is_plain_pointwise(expand)):
        return None
    return (reduce._parameters["weight"], reduce._parameters["bias"], expand._parameters["weight"],
            expand._parameters["bias"], activation, gate)


def _is_plain_pointwise(conv: Optional[nn.Module]) -> bool:
    """Whether conv is an nn.Conv2d itself (not a subclass, whose forward may differ), _is_pointwise."""
    return type(conv) is nn.Conv2d and _is_pointwise(conv)


def find_squeeze_excites(model: nn.Module) -> List[nn.Module]:
    """Each module of a _SQUEEZE_EXCITE_CLASSES class whose members the op computes: 1x1 convolutions
    from the input's channels and back (at most MAX_HIDDEN between), an activation of
    ACTIVATION_CODES, a sigmoid or hard sigmoid gate, and (torchvision's) an average pool to 1x1.
    Each takes the role of _SqueezeExcite."""
    found = []
    for module in model.modules():
        names = _SQUEEZE_EXCITE_CLASSES.get((type(module).__module__, type(module).__name__))
        if names is None:
            continue
        reduce, activation, expand, gate, pool = (module._modules.get(name) if name else None for name in names)
        if not (_is_plain_pointwise(reduce) and _is_plain_pointwise(expand)
                and reduce.in_channels == expand.out_channels
                and reduce.out_channels == expand.in_channels <= squeeze_excite_kernels.MAX_HIDDEN):
            continue
        activation_name = activation_of(activation) if isinstance(activation, nn.Module) else None
        gate_code = 0 if type(gate) is nn.Sigmoid else 1 if activation_of(gate) == "hardsigmoid" else None
        if activation_name is None or gate_code is None:
            continue
        if names[4] is not None and not (type(pool) is nn.AdaptiveAvgPool2d and pool.output_size in (1, (1, 1))):
            continue
        places = tuple((module, name, member) for name, member in zip(names, (reduce, activation, expand, gate, pool))
                       if name)
        module.__dict__["dwconv_squeeze"] = (places, ACTIVATION_CODES[activation_name], gate_code)
        module.__class__ = folded_class("squeeze excite", type(module))
        found.append(module)
    return found


def _normalized_in_training(conv: FusedDepthwiseConv2d, y: torch.Tensor) -> torch.Tensor:
    """The block's BatchNorm (training) and activation after its convolution's output y."""
    _, norm, activation_module, _ = conv.dwconv_block
    return _trained(norm, activation_module, conv.dwconv_activation, y)


def _trained(norm: nn.BatchNorm2d, activation_module: Optional[nn.Module], activation: str,
             y: torch.Tensor) -> torch.Tensor:
    """activation(norm(y)) for norm in training: on the kernels of dwconv.batch_norm where they read
    y and nothing would see inside the call (autograd of any order is fine; forward-mode AD,
    torch.func, tracing, subclasses are not), under torch.compile as its registered op, else the
    modules' own forwards."""
    # (from the modules' own dicts: this runs at every training call, Module.__getattr__ costs)
    buffers, parameters = norm._buffers, norm._parameters
    running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
    tensors = (parameters.get("weight"), parameters.get("bias"), running_mean, running_var)
    if precompile._TRACING.__dict__.get("active") and norm.track_running_stats and running_mean is not None:
        precompile.record_batch_norm(y, norm, activation)  # (a warmup's fake run: compile its kernels)
    if (type(y) is torch.Tensor and running_mean is not None and running_var is not None and y.dim() == 4
            and y.is_floating_point() and functional.uses_triton(y) and forward_ad._current_level < 0
            and norm.track_running_stats
            and all(t is None or (type(t) in PLAIN_TENSORS and t.device == y.device) for t in tensors)):
        # (the registered op, under compiled autograd too; Dynamo answers the transforms' questions itself)
        if torch.compiler.is_compiling() or functional.compiled_autograd_on():
            if norm.momentum is not None:
                return compiled_batch_norm_activation(y, norm, activation)
        elif not torch._C._is_tracing() and not functional._pytorch_must_run(y, *tensors):
            return batch_norm_activation(y, norm, activation)
    return batch_norm_reference(y, norm, activation_module)


def _folded_parameters(conv: nn.Conv2d, norm: nn.BatchNorm2d, input: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """fold_batch_norm of a trained block's convolution in eval mode, computed at each call: in the
    graph where autograd, torch.compile, tracing or torch.func must see it, else by one launch in the
    dtype the convolution computes in (autocast's: its cast of the weight is then none)."""
    block_tensors = tensors_of(conv, norm)
    tensors = [t for t in block_tensors if t is not None]
    if precompile._TRACING.__dict__.get("active"):  # (a warmup's fake run: the fold compiles in its pool)
        if not _gradient_wanted(*tensors):
            precompile.record_fold(conv.weight, conv.bias, norm, _compute_dtype(input, conv.weight))
        return fold_batch_norm(conv.weight, conv.bias, norm)
    if (torch.compiler.is_compiling() or torch._C._is_tracing() or _gradient_wanted(*tensors)
            or torch._C._functorch.peek_interpreter_stack() is not None
            or any(type(t) is not torch.Tensor and type(t) is not nn.Parameter for t in tensors)):
        return fold_batch_norm(conv.weight, conv.bias, norm)
    return folded_now(*block_tensors, norm.eps, _compute_dtype(input, block_tensors[0]))


def _compute_dtype(input: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a convolution of input by weight computes in: autocast's where it casts (floating
    tensors other than float64), else the weight's."""
    device = input.device.type
    if torch.is_autocast_enabled(device) and weight.is_floating_point() and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return weight.dtype


def tensors_of(conv: nn.Conv2d, norm: Optional[nn.BatchNorm2d]) -> tuple:
    """(weight, bias, norm's weight, norm's bias, running mean, running variance), the last four
    without a norm, from the modules' own dicts (Module.__getattr__ costs a few us at every call; a
    parametrized module never gets here: fused_now)."""
    parameters = conv._parameters
    if norm is None:
        return parameters["weight"], parameters["bias"]
    return (parameters["weight"], parameters["bias"]) + _norm_tensors(norm)


def _norm_tensors(norm: nn.BatchNorm2d) -> tuple:
    """(weight, bias, running mean, running variance) of a BatchNorm, from its own dicts."""
    norm_parameters, buffers = norm._parameters, norm._buffers
    return norm_parameters["weight"], norm_parameters["bias"], buffers["running_mean"], buffers["running_var"]


def folded_now(weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
               norm_bias: Optional[torch.Tensor], running_mean: torch.Tensor, running_var: torch.Tensor,
               eps: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """fold_batch_norm's (weight, bias) in dtype, nothing differentiated, from the tensors as they
    are now: never kept from an earlier call, since a change made through `.data` (an old EMA's
    update, say) moves no version counter and a kept folding would then be silently stale. One
    launch (kernels/batch_norm.fold) where the kernels read the tensors, else PyTorch's ops."""
    device = weight.device
    for t in (bias, norm_weight, norm_bias, running_mean, running_var):  # (each 1-D, as the modules make them)
        if t is not None and (t.device != device or t.stride(0) != 1 or not t.is_floating_point()):
            break
    else:
        if functional.uses_triton(weight) and (weight.is_contiguous()
                                               or weight.is_contiguous(memory_format=torch.channels_last)):
            # (from C++ where the replayer is on: the Python of the launch was most of the folding's host time)
            return replayed(batch_norm_kernels.fold, [weight, bias, norm_weight, norm_bias, running_mean, running_var],
                            eps, dtype)
    with torch.no_grad():
        weight, bias = fold_parameters(weight, bias, norm_weight, norm_bias, running_mean, running_var, eps)
    return weight.to(dtype), bias.to(dtype)


def _traced_as_a_call(module: nn.Module, input: torch.fx.Proxy) -> torch.fx.Proxy:
    """Under torch.fx's symbolic trace: one call of the module, so that the traced graph decides
    between the fused and the plain block when it runs (a trace would keep one mode's branch)."""
    return input.tracer.create_proxy("call_module", input.tracer.path_of_module(module), (input,), {})


# a block's module roles: (the behaviour mixed in, the class name's prefix)
_ROLES = {"norm": (_PassedThrough, "Folded"), "activation": (_PassedThrough, "Fused"),
          "trained norm": (_TrainedNorm, "Trained"), "trained activation": (_TrainedActivation, "Trained"),
          "trained conv": (_FoldingConv, "Folding"), "squeeze excite": (_SqueezeExcite, "Fused"),
          "replayed block": (ReplayedBlock, "Replayed")}


@functools.lru_cache(maxsize=None)
def folded_class(role: str, cls: type) -> type:
    """cls with a block's role (a subclass, so its own forward, super() calls and isinstance hold),
    one class for each (_ROLES: a depthwise block's "norm" or "activation", a trained block's
    "trained norm", "trained activation" or "trained conv"; a "squeeze excite" module). Pickled and
    copied by role and class."""
    mixin, prefix = _ROLES[role]
    return type(prefix + cls.__name__, (mixin, cls),
                {"__reduce_ex__": _reduce, "__module__": __name__, "dwconv_role": role})


def _reduce(module: nn.Module, protocol: int):
    cls = type(module)
    return _rebuild, (cls.dwconv_role, cls.__mro__[2]), module.__dict__.copy()


def _rebuild(role: str, cls: type) -> nn.Module:
    fused = folded_class(role, cls)
    return fused.__new__(fused)


def fold_batch_norm(weight: torch.Tensor, bias: Optional[torch.Tensor], norm: nn.BatchNorm2d
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the convolution followed by norm in eval mode: y = (conv(x) + b - mean) *
    gamma / sqrt(var + eps) + beta, per output channel (differentiable in every parameter)."""
    return fold_parameters(weight, bias, norm.weight, norm.bias, norm.running_mean, norm.running_var, norm.eps)


def fold_parameters(weight: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                    norm_bias: Optional[torch.Tensor], running_mean: torch.Tensor, running_var: torch.Tensor,
                    eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """fold_batch_norm from the BatchNorm's tensors, in PyTorch's ops, in the weight's dtype."""
    scale = torch.rsqrt(running_var + eps)
    if norm_weight is not None:
        scale = scale * norm_weight
    shift = -running_mean * scale if bias is None else (bias - running_mean) * scale
    if norm_bias is not None:
        shift = shift + norm_bias
    return weight * scale.to(weight.dtype).view(-1, 1, 1, 1), shift.to(weight.dtype)



# ---- finding blocks -------------------------------------------------------------------------------

class _ChildrenAsLeaves(torch.fx.Tracer):
    def __init__(self, parent: nn.Module):
        super().__init__()
        self.children_ids = {id(child) for child in parent.children()}

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return id(m) in self.children_ids or super().is_leaf_module(m, qualified_name)


def _dataflow(parent: nn.Module) -> Optional[Dict[str, Tuple[str, ...]]]:
    """For each child called exactly once in parent.forward (traced by torch.fx with the children as
    leaves): the children that alone take its output as their only argument, in order (a chain
    conv -> norm -> act). None where the forward does not trace."""
    try:
        graph = _ChildrenAsLeaves(parent).trace(parent)
    except Exception:  # (control flow on values, unsupported calls: nothing is proven)
        return None
    calls = collections.Counter(node.target for node in graph.nodes if node.op == "call_module")
    flow = {}
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        users = list(node.users)
        if len(users) == 1 and users[0].op == "call_module" and calls[users[0].target] == 1 \
                and users[0].args == (node,) and not users[0].kwargs:
            flow[node.target] = (users[0].target,)
        else:
            flow[node.target] = ()
    return flow


def _in_both_modes(parent: nn.Module) -> Optional[Dict[str, Tuple[str, ...]]]:
    """_dataflow with parent.training False and True (a forward may branch on it); None unless the same."""
    was = parent.training
    flows = []
    for mode in (False, True):
        parent.training = mode  # (this module's flag only: its children are leaves)
        flows.append(_dataflow(parent))
    parent.training = was
    return flows[0] if flows[0] == flows[1] else None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _foldable_norm(module: nn.Module, conv: Optional[DepthwiseConv2d]) -> Tuple[bool, str]:
    """(whether module is a BatchNorm2d that folds into conv (conv None: that a trained block can
    compute), the activation inside it: timm's BatchNormAct2d applies one)."""
    inner = "identity"
    if type(module) is not nn.BatchNorm2d:
        if not (isinstance(module, nn.BatchNorm2d) and type(module).__name__ == "BatchNormAct2d"
                and type(getattr(module, "drop", None)) is nn.Identity and activation_of(module.act)):
            return False, inner
        inner = activation_of(module.act)
    ok = (module.track_running_stats and module.running_mean is not None
          and (conv is None or module.num_features == conv.out_channels) and not _hooked(module))
    return ok, inner


def find_blocks(model: nn.Module) -> Tuple[List[Block], collections.Counter]:
    """The fusable blocks of model's converted depthwise layers, and why the other layers are not."""
    uses = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    blocks, left = [], collections.Counter()
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        convs = {name: child for name, child in children.items() if type(child) is DepthwiseConv2d}
        if not convs:
            continue
        flow = _in_both_modes(parent)
        for name, conv in convs.items():
            if flow is None:
                left["its module's forward does not trace with torch.fx"] += 1
                continue
            if uses[id(conv)] > 1 or _hooked(conv) or conv.activation is not None or conv.padding_mode != "zeros":
                left["used twice, hooked, already activated or padding other than zeros"] += 1
                continue
            chain = [name]
            while len(chain) < 3 and flow.get(chain[-1]):
                chain.append(flow[chain[-1]][0])
            modules = [children[n] for n in chain[1:] if n in children]
            norm, activation, activation_module = None, "identity", None
            if modules:
                ok, inner = _foldable_norm(modules[0], conv)
                if ok and uses[id(modules[0])] == 1:
                    norm, activation = modules.pop(0), inner
            if modules and activation == "identity" and activation_of(modules[0]) \
                    and uses[id(modules[0])] == 1 and not _hooked(modules[0]):
                activation_module, activation = modules[0], activation_of(modules[0])
            if norm is None and activation_module is None:
                left["followed by neither a BatchNorm2d nor an activation module"] += 1
                continue
            places = [(parent, n, children[n]) for n in chain if children[n] in (conv, norm, activation_module)]
            if norm is not None and type(norm) is not nn.BatchNorm2d:  # (timm's BatchNormAct2d: its own act)
                places += [(norm, "drop", norm.drop), (norm, "act", norm.act)]
            blocks.append((conv, norm, activation_module, activation, tuple(places)))
    return blocks, left


def find_norm_blocks(model: nn.Module, taken: set) -> List[Block]:
    """The model's other BatchNorm2d (not in a depthwise block: ids in taken) that dwconv's kernels
    can compute in training, each with the activation module that alone takes its output and the
    nn.Conv2d whose output it alone takes, where that is proven as find_blocks proves a block (alone
    where it is not: a BatchNorm by itself needs no proof): blocks whose layer is that convolution or
    None."""
    uses = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    blocks = []
    for parent in model.modules():
        children = dict(parent.named_children())
        norms = {name: (child, _foldable_norm(child, None)) for name, child in children.items()
                 if id(child) not in taken and uses[id(child)] == 1}
        norms = {name: (norm, inner) for name, (norm, (ok, inner)) in norms.items() if ok}
        flow = (_in_both_modes(parent) if norms else None) or {}
        for name, (norm, activation) in norms.items():
            following = flow.get(name)
            activation_module = children.get(following[0]) if following else None
            if not (activation == "identity" and activation_module is not None and activation_of(activation_module)
                    and uses[id(activation_module)] == 1 and not _hooked(activation_module)
                    and id(activation_module) not in taken):
                activation_module = None
            else:
                activation = activation_of(activation_module)
            producers = [n for n, users in flow.items() if users == (name,)]
            conv = children[producers[0]] if producers else None
            if not (type(conv) is nn.Conv2d and uses[id(conv)] == 1 and not _hooked(conv)
                    and conv.out_channels == norm.num_features):
                conv = None
            members = (producers[0] if conv is not None else None, name,
                       following[0] if activation_module is not None else None)
            places = [(parent, n, children[n]) for n in members if n is not None]
            if type(norm) is not nn.BatchNorm2d:  # (timm's BatchNormAct2d: its own act)
                places += [(norm, "drop", norm.drop), (norm, "act", norm.act)]
            blocks.append((conv, norm, activation_module, activation, tuple(places)))
    return blocks


def find_input_activations(model: nn.Module, blocks: List[Block], norm_blocks: List[Block]) -> list:
    """(trained block, its activation, the depthwise layer its output feeds alone, the modules
    between) for each trained block with a convolution whose activation (one of INPUT_ACTIVATIONS,
    not the identity) feeds a fused depthwise layer and nothing else: MobileNets' and EfficientNets'
    expansion -> depthwise. Proven through the module tree with torch.fx (each parent's forward
    traced with its children as leaves, in both modes): from the activation up through each parent
    whose forward returns it alone, across to the one sibling that alone takes it, down through each
    module whose forward passes its one input to one child alone; nn.Identity modules on the way
    pass it on. Each module on the path is used once in the model."""
    uses = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    parents = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            parents[id(child)] = (parent, name)
    flows, ends = {}, {}

    def flow_of(parent):
        if id(parent) not in flows:
            flows[id(parent)] = _in_both_modes(parent)
        return flows[id(parent)]

    def ends_of(parent):
        if id(parent) not in ends:
            ends[id(parent)] = _ends_in_both_modes(parent)
        return ends[id(parent)]

    depthwise = {id(block[0]) for block in blocks}
    links = []
    for block in norm_blocks:
        conv, norm, activation_module, activation, _ = block
        if conv is None or activation not in INPUT_ACTIVATIONS or activation == "identity":
            continue
        current, between, target = activation_module if activation_module is not None else norm, [], None
        while target is None:  # (up, then across)
            if id(current) not in parents:
                break
            parent, name = parents[id(current)]
            flow = flow_of(parent)
            following = flow.get(name) if flow is not None else None
            if following:
                target = parent._modules[following[0]]
            elif (following is not None and (ends_of(parent) or (None, None))[1] == name and id(parent) in parents
                  and uses[id(parent)] == 1):
                between.append((*parents[id(parent)], parent))
                current = parent
            else:
                break
            if target is not None and type(target) is nn.Identity and not _hooked(target) and uses[id(target)] == 1:
                between.append((parent, following[0], target))
                current, target = target, None
        while target is not None and id(target) not in depthwise:  # (down)
            entry = (ends_of(target) or (None, None))[0] if target._modules else None
            if entry not in target._modules or uses[id(target)] != 1:
                target = None
                break
            between.append((*parents[id(target)], target))
            target = target._modules[entry]
        if target is not None and uses[id(target)] == 1:
            links.append((block, activation, target, tuple(between)))
    return links


def _ends(parent: nn.Module) -> Optional[Tuple[Optional[str], Optional[str]]]:
    """(the child that alone takes parent.forward's one input, the child whose output parent.forward
    alone returns), each called once, or None for either; None where the forward does not trace."""
    try:
        graph = _ChildrenAsLeaves(parent).trace(parent)
    except Exception:
        return None
    nodes = list(graph.nodes)
    calls = collections.Counter(node.target for node in nodes if node.op == "call_module")
    inputs = [node for node in nodes if node.op == "placeholder"]
    entry = exit = None
    if len(inputs) == 1 and len(inputs[0].users) == 1:
        user = next(iter(inputs[0].users))
        if user.op == "call_module" and user.args == (inputs[0],) and not user.kwargs and calls[user.target] == 1:
            entry = user.target
    output = [node for node in nodes if node.op == "output"]
    if len(output) == 1 and isinstance(output[0].args[0], torch.fx.Node):
        result = output[0].args[0]
        if result.op == "call_module" and len(result.users) == 1 and calls[result.target] == 1:
            exit = result.target
    return entry, exit


def _ends_in_both_modes(parent: nn.Module) -> Optional[Tuple[Optional[str], Optional[str]]]:
    """_ends with parent.training False and True; None unless the same."""
    was = parent.training
    found = []
    for mode in (False, True):
        parent.training = mode
        found.append(_ends(parent))
    parent.training = was
    return found[0] if found[0] == found[1] else None


def fuse_blocks(model: nn.Module) -> Tuple[List[Block], collections.Counter, int, int, int]:
    """Makes each block find_blocks proves a fused one, and each find_norm_blocks proves a trained
    one (the modules' classes change), links each find_input_activations finds, makes each
    squeeze-and-excitation module find_squeeze_excites finds one op, and each inverted-residual
    block find_replayed_blocks finds one replayed program in eager eval; returns the blocks (the
    depthwise blocks first), why other converted layers are not fused, how many activations their
    depthwise layer applies in eval mode, how many squeeze-and-excitation modules are one op, and
    how many blocks one program."""
    blocks, left = find_blocks(model)
    taken = {id(m) for block in blocks for m in block[1:3] if m is not None}
    norm_blocks = find_norm_blocks(model, taken)
    for conv, norm, activation_module, activation, places in blocks:
        # (the norm as a plain attribute, not a submodule: its parameters stay where they were, once)
        block = (conv, norm, activation_module, places)  # (each member asks fused_now of the whole block)
        conv.__class__ = FusedDepthwiseConv2d
        conv.__dict__.update(dwconv_activation=activation, dwconv_block=block)
        _join(block, ((norm, "norm"), (activation_module, "activation")))
    for conv, norm, activation_module, activation, places in norm_blocks:
        block = (conv, norm, activation_module, places)
        norm.__dict__["dwconv_activation"] = activation
        _join(block, ((norm, "trained norm"), (conv, "trained conv"), (activation_module, "trained activation")))
    links = find_input_activations(model, blocks, norm_blocks)
    for (conv, norm, activation_module, _, _), activation, depthwise, between in links:
        depthwise.__dict__["dwconv_input"] = (norm.dwconv_block, activation, between)
        (activation_module if activation_module is not None else norm).__dict__["dwconv_applied_by"] = depthwise
    squeeze_excites = len(find_squeeze_excites(model))
    replayed_blocks = find_replayed_blocks(model)
    for block in replayed_blocks:
        block.__dict__["dwconv_programs"] = BlockPrograms()
        block.__class__ = folded_class("replayed block", type(block))
    return blocks + norm_blocks, left, len(links), squeeze_excites, len(replayed_blocks)


def _join(block: tuple, members: tuple) -> None:
    """Each (module or None, role): the module takes its role's class and knows its block."""
    for module, role in members:
        if module is not None:
            module.__dict__["dwconv_block"] = block
            module.__class__ = folded_class(role, type(module))
