"""Model families: each kind of model the engine can serve, in a package of its own.

    family.py      the interface a family implements (ModelFamily) and the registry that detects a directory's family
    loading.py     what every family's loader shares: placement over devices, adapter discovery, ModelDirError
    checkpoint.py  a checkpoint checked against its config before anything is allocated
    hf.py          pieces shared by the families that load a transformers checkpoint
    shapes/        the embedded model: the shapes world, its tokenizers, loader, training data and exact checker
    emu3/ chameleon/ janus/   real checkpoints through transformers

The engine, the pipeline and the app import no family by name; the registry imports the built-in ones on the first
lookup.
"""
