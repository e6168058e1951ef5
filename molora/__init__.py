"""MoLoRA: per-token LoRA routing for models that write text and images.

    molora.kernels   routed-LoRA kernels (PyTorch reference, torch CPU path, Triton GPU)
    molora.routing   routers, the routed linear layer, the hot-set adapter cache
    molora.models    the Python API (pipeline, document, batch, CLI), the serving engine, the model families
    molora.app       the Gradio demo

Every package of ours lives inside this one, so a checkout or an installed copy adds ONE top-level name, `molora`,
to the import path: a generic name such as `kernels` (Hugging Face's package, which transformers imports) is never
shadowed, whichever folder Python starts in.
"""
