"""The C++ path of eager calls: a layer's passes recorded once (program.py) and replayed by an
autograd Function written in C++ (replay.cpp, built by native.py at first use), which launches the
compiled kernels through cuLaunchKernel without Python. Small layers are bound by host time; this
path cuts it several fold. The one entry point for a call is `conv` (`conv_known` for a call whose
tensors and arguments were seen before); the registered ops' calls (torch.compile's graphs) take it
through `serve_ops`.
"""

from .native import BuildFailed, conv, conv_known, enabled, extension, forget_layers, prepare, serve_ops, serving_ops

__all__ = ["BuildFailed", "conv", "conv_known", "enabled", "extension", "forget_layers", "prepare", "serve_ops",
           "serving_ops"]
