"""The project's base exception, and the kernels package's own error type.

`MoLoRAError` lives here, in the bottom layer, so that every package (kernels/, routing/, models/, app/,
scripts/) can derive its errors from it without importing a layer above its own: a caller catches one type.
routing/errors.py re-exports it with the routing errors.
"""

from __future__ import annotations


class MoLoRAError(Exception):
    """Base class of every error raised on purpose by this project."""


class KernelInputError(MoLoRAError, ValueError):
    """A routed-LoRA op was called with tensors of the wrong shape, dtype or device (a ValueError too)."""
