"""The Triton kernels, one family a module (see dwconv/dispatch.py for which runs where)."""
