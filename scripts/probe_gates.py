"""How well CAN a per-block linear gate tell the domains apart? A linear probe on the frozen base model's block
inputs at the positions that predict an answer id (the positions the router's agreement is measured on).

Per block: softmax regression Linear(d_model, E) (no bias, like a gate), Adam, full batch, on the block inputs of
train-split items, scored on held-out items; with and without an RMS normalisation of the input. The probe's
accuracy is an upper bound of what a gate of that block can learn from those features (the routed model's states
differ a little, since the adapters change them).

    python scripts/probe_gates.py --n 150 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_router import answer_positions, load_routed, shapes_data  # noqa: E402

from molora.models.families.shapes.domain_batches import make_batch  # noqa: E402
from molora.models.families.shapes.domains import DOMAINS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def features(routed, data, adapters: list[str]) -> tuple[list[torch.Tensor], torch.Tensor]:
    per_block: list[list[torch.Tensor]] = [[] for _ in range(routed.num_blocks)]
    labels = []
    for i in range(0, len(data), 50):
        batch = make_batch(data, range(i, min(i + 50, len(data))), 0, adapters)
        hidden = routed.model(batch.ids, output_hidden_states=True, use_cache=False).hidden_states
        sel = answer_positions(batch)
        for b in range(routed.num_blocks):
            per_block[b].append(hidden[b][sel])  # hidden_states[b] is the input of block b
        labels.append(batch.labels[sel])
    return [torch.cat(x) for x in per_block], torch.cat(labels)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    p.add_argument("--n", type=int, default=150, help="train items per domain (+ mixed); a third as many held out")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    adapters = list(DOMAINS)
    routed, tok = load_routed(args.model_dir, args.adapters_dir, adapters)
    routed.eval()
    xt, yt = features(routed, shapes_data(tok, adapters, args.n, "probe", "train"), adapters)
    xv, yv = features(routed, shapes_data(tok, adapters, max(1, args.n // 3), "probe-val", "heldout"), adapters)
    result = {}
    for b in range(routed.num_blocks):
        for norm in (False, True):
            f = (lambda z: z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)) if norm else (lambda z: z)
            w = torch.zeros(xt[b].shape[1], len(adapters), requires_grad=True)
            opt = torch.optim.Adam([w], lr=1e-2)
            for _ in range(args.steps):
                loss = F.cross_entropy(f(xt[b]) @ w, yt)
                opt.zero_grad()
                loss.backward()
                opt.step()
            acc = float(((f(xv[b]) @ w).argmax(-1) == yv).float().mean())
            result[f"block{b}{'_rms' if norm else ''}"] = round(acc, 4)
    result["positions"] = {"train": int(yt.numel()), "val": int(yv.numel())}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
