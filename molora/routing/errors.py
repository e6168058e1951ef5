"""The project's exception types.

Every error a user can cause (a bad adapter file, an unknown name, a full cache, a routing request the model
cannot honour) is raised as a subclass of `MoLoRAError`, with a message that says what went wrong and what to do.
Other packages subclass `MoLoRAError` for their own errors so callers can catch one type.  The base class itself is
defined at the bottom layer (kernels/errors.py) so kernels/ can derive from it too; it is re-exported here.
"""

from __future__ import annotations

from molora.kernels.errors import MoLoRAError

__all__ = ["MoLoRAError", "AdapterError", "UnknownAdapterError", "CacheFullError", "RoutingError"]


class AdapterError(MoLoRAError):
    """An adapter file or object that cannot be used with this model (format, values, shapes, base model)."""


class UnknownAdapterError(AdapterError, KeyError):
    """A name that no loaded adapter has."""

    def __str__(self) -> str:  # KeyError would otherwise print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class CacheFullError(MoLoRAError):
    """More distinct adapters requested at once than the hot set has free (unpinned) slots."""


class RoutingError(MoLoRAError):
    """A routing request that does not fit the batch or the model (wrong router count, shapes, gate sizes)."""
