"""The kernels package's own error type.

kernels/ must not import routing/ (where the project's base MoLoRAError lives), so bad input to the ops raises
KernelInputError, a ValueError; routing/ catches it where it wants to re-raise its own type.
"""

from __future__ import annotations


class KernelInputError(ValueError):
    """A routed-LoRA op was called with tensors of the wrong shape, dtype or device."""
