"""The shapes world's exception type: a bad scene, attribute, split, style or register."""

from __future__ import annotations

from molora.routing.errors import MoLoRAError


class ShapesError(MoLoRAError, ValueError):
    """An input the shapes world cannot honour; the message names the value and what is allowed."""
