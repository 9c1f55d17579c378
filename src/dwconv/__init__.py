"""dwconv: fast depthwise 2-D convolution for PyTorch, in Triton."""

from .convert import convert
from .functional import depthwise_conv2d
from .modules import DepthwiseConv2d
from .precompile import warmup

__all__ = ["convert", "depthwise_conv2d", "DepthwiseConv2d", "warmup"]
__version__ = "0.1.0"
