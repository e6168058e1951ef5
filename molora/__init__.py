"""MoLoRA: per-token LoRA routing for models that write text and images.

The code lives in four packages, imported as `molora.kernels`, `molora.routing`, `molora.models` and `molora.app`.
An installed copy (`pip install .`) holds them inside this package, so it adds one top-level name, `molora`, and
shadows nothing (Hugging Face's `kernels` distribution included). A source checkout keeps them at the top of the
repository, the layout the project is browsed in; for that case this package also searches the checkout's root.
"""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "kernels").is_dir() and (_HERE.parent / "kernels" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # a checkout: molora.kernels is <root>/kernels
