"""Store a LoRA folder's weights in another dtype (PEFT format, through the project's validated loader and writer):
the shipped rank-16 style adapters are kept as bfloat16, which halves them and keeps assets/ within its budget.

    python scripts/store_adapter.py assets/adapters/outline --dtype bfloat16

The folder's adapter_config.json and adapter_model.safetensors are rewritten in place; molora.json and metrics.json
stay. The values are the old ones rounded to the dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.routing.adapters import LORA_DTYPES, load_peft_adapter, save_peft_adapter  # noqa: E402

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in LORA_DTYPES.values()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, nargs="+", help="adapter folders (adapter_config.json + weights)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    for folder in args.folder:
        adapter = load_peft_adapter(folder, force=True)
        save_peft_adapter(adapter, folder, dtype=DTYPES[args.dtype])
        print(f"{folder}: {len(adapter.weights)} modules stored as {args.dtype}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
