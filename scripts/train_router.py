"""Train MoLoRA learned gates over frozen adapters: base and adapters frozen, only the gates train.

Per transformer block a gate Linear(d_model, E) on the block input picks the top-k of E adapters per token
(routing/routers.py LearnedGates / LearnedRouter, hierarchical: image positions never reach the gate); with
--context-decays (default: the shipped router's nine, 0.5 ... 0.99) every gate also reads the routing state,
causal moving averages of the token embeddings, so block 0 sees which question is being answered
(benchmarks/RESULTS.md, issue 12).
With labels, --start-weight weighs the label loss at span starts, where the gate must switch (the shipped router: 5,
with --label-coef 1.0 and --n-mixed 3x --n-per-domain; its command is in assets/model/README.md). The loss
is the next-token loss on the answer ids (the whole text when a record has no prompt) + lb * Switch load-balance
loss + z * router z-loss (both from RoutedModel.forward, averaged over blocks; computed in training only), and,
when records carry domain labels and --label-coef > 0, a cross-entropy of every block's gate logits against the
labels: the domain on the positions that predict an answer id, and (with the base expert, the default) "base" on
the prompt positions, which domain adapters read as the base model wrote them (scripts/train_domain_adapters.py).
Top-k is the k of training; the gates are trained at k = 2 (softmax over the two kept logits: at k = 1 the kept
weight is always 1 and the next-token loss gives the gate no gradient) and serve at k = 1 or 2.

Data: by default the shapes question domains (models/families/shapes/domains.py, train split): --n-per-domain items of each
adapter's domain and --n-mixed mixed requests (default as many), and --picture-requests picture requests (the words
before a picture, context throughout: the label loss sends them to the base expert, so learned mode leaves a
picture's prompt as the base model reads it); validation on held-out items. Or your own adapters and texts:

    --data my.jsonl  one JSON object a line: {"text": "..."} (loss on every id), or {"prompt": "...",
                     "answer": "..."} (loss on the answer), optional "domain": "<adapter name>" (routing
                     agreement, and the label loss with --label-coef)
    --val-data v.jsonl   same format (default: 10% of --data, held apart)

Writes OUT/gates.safetensors (LearnedGates.save: names in its metadata) and OUT/config.json (adapters, top_k,
coefficients, steps, seed, validation metrics, the adapters' file hashes). InterleavedPipeline.from_pretrained
loads <model>/../router/gates.safetensors by default (models/families/loading.py).

    python scripts/train_router.py --out assets/router --adapters count arith spatial size
    python scripts/train_router.py --adapters-dir my_adapters --adapters a b c --data my.jsonl --out my_router
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.engine.runtime import device_name  # noqa: E402
from molora.models.families.loading import ModelDirError, adapter_rank, adapter_weights_hash  # noqa: E402
from molora.models.families.shapes.data import Schedule  # noqa: E402
from molora.models.families.shapes.domain_batches import (  # noqa: E402
    EncodedItem,
    answer_loss,
    encode_item,
    encode_prompt_answer,
    exact_matches,
    make_batch,
)
from molora.models.families.shapes.domains import DOMAINS, domain_items, mixed_items  # noqa: E402
from molora.models.families.shapes.styles import style_items  # noqa: E402
from molora.models.families.shapes.testing import LORA_TARGETS, set_base_model_name  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402
from molora.routing import LearnedGates, LearnedRouter, MoLoRAError, RoutedModel, attach_routed_lora  # noqa: E402
from molora.routing.routers import GATES_FORMAT_VERSION  # noqa: E402

log = logging.getLogger("train_router")
SHIPPED_DECAYS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.99)  # assets/router: span starts read best (RESULTS.md)
REPO = Path(__file__).resolve().parents[1]


class RouterDataError(MoLoRAError, ValueError):
    """A --data file that cannot be used: says which line and what to fix (a ValueError too)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=REPO / "assets" / "model")
    p.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    p.add_argument("--adapters", nargs="+", default=list(DOMAINS), help="adapter folder names the gates route over")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None, help="jsonl of texts (default: the shapes question domains)")
    p.add_argument("--val-data", type=Path, default=None)
    p.add_argument("--n-per-domain", type=int, default=1500, help="generated data: train items per domain (+ mixed)")
    p.add_argument("--n-val", type=int, default=100, help="generated data: held-out items per domain (+ mixed)")
    p.add_argument("--n-mixed", type=int, default=None,
                   help="generated data: mixed train requests (two domains in one answer; default --n-per-domain)")
    p.add_argument("--picture-requests", type=int, default=0,
                   help="generated data: also this many picture requests (the shapes world's styled requests, train "
                        "split), context throughout: with the base expert and --label-coef, the gates learn to leave "
                        "the words before a picture to the base model")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lb-coef", type=float, default=0.01, help="Switch load-balance loss coefficient")
    p.add_argument("--z-coef", type=float, default=1e-3, help="router z-loss coefficient")
    p.add_argument("--label-coef", type=float, default=0.0, help="gate cross-entropy on domain labels (if given)")
    p.add_argument("--start-weight", type=float, default=1.0,
                   help="weight of the label loss at span starts (answer positions whose label differs from the "
                        "position before: where the gate must switch) against 1 at the other answer positions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--base-expert", action=argparse.BooleanOptionalAction, default=True,
                   help="one more gate output meaning 'no adapter' (context positions go there)")
    p.add_argument("--context-decays", type=float, nargs="*", default=list(SHIPPED_DECAYS),
                   help="gates also read causal moving averages of the token embeddings with these decays (default "
                        "the shipped router's nine; --context-decays with no value: the block input only)")
    p.add_argument("--max-minutes", type=float, default=0.0)
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: at the end only)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from these gates (adding an adapter: its rows start at zero, the others kept)")
    p.add_argument("--train-new-only", action="store_true",
                   help="with --init-from: train only the gate rows of adapters those gates did not have")
    args = p.parse_args(argv)
    if args.start_weight <= 0:
        p.error(f"--start-weight must be > 0 (got {args.start_weight}): it weighs the label loss at span starts")
    return args


# --- model and adapters ------------------------------------------------------------------------------------

def load_routed(model_dir: Path, adapters_dir: Path, names: list[str], device: str = "cpu"
                ) -> tuple[RoutedModel, UnifiedTokenizer]:
    """The frozen base (fp32) with the named adapter folders loaded into a hot set that holds them all."""
    missing = [n for n in names if not (adapters_dir / n / "adapter_config.json").is_file()]
    if missing:
        raise ModelDirError(f"no adapter folder for {missing} under {adapters_dir} (each needs adapter_config.json "
                            "and adapter_model.safetensors)")
    tok = UnifiedTokenizer.load(model_dir)
    lm = LlamaForCausalLM.from_pretrained(model_dir / "lm", dtype=torch.float32).to(device)
    set_base_model_name(lm)
    lm.requires_grad_(False).train()  # no dropout in this model; train mode skips building a KV cache
    r_max = max([8, *(adapter_rank(adapters_dir / n) for n in names)])
    routed = attach_routed_lora(lm, target_modules=LORA_TARGETS, num_slots=max(1, len(names)), r_max=r_max)
    for n in names:
        routed.load_adapter(adapters_dir / n, name=n)
    return routed, tok


def file_hashes(adapters_dir: Path, names: list[str]) -> dict[str, str]:
    return {n: adapter_weights_hash(adapters_dir / n) for n in names}


# --- data --------------------------------------------------------------------------------------------------

def read_jsonl(path: Path, tok: UnifiedTokenizer, adapters: list[str]) -> list[EncodedItem]:
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RouterDataError(f"{path}:{lineno}: not JSON ({exc})") from exc
        if not isinstance(rec, dict) or not (isinstance(rec.get("text"), str) or (
                isinstance(rec.get("prompt"), str) and isinstance(rec.get("answer"), str))):
            raise RouterDataError(f"{path}:{lineno}: need {{\"text\": str}} or {{\"prompt\": str, \"answer\": str}}")
        domain = rec.get("domain")
        if domain is not None and domain not in adapters:
            raise RouterDataError(f"{path}:{lineno}: domain {domain!r} is not one of the adapters {adapters}")
        if "text" in rec:
            records.append(encode_prompt_answer(tok, rec["text"], None, domain))
        else:
            records.append(encode_prompt_answer(tok, rec["prompt"], rec["answer"], domain))
    if not records:
        raise RouterDataError(f"{path} holds no records")
    return records


def shapes_data(tok: UnifiedTokenizer, adapters: list[str], n: int, seed: str, split: str,
                n_mixed: int | None = None) -> list[EncodedItem]:
    """`n` items of each adapter's domain and `n_mixed` (default `n`) mixed requests over them."""
    unknown = [a for a in adapters if a not in ("count", "arith", "spatial", "size", "mix")]
    if unknown:
        raise RouterDataError(f"adapters {unknown} are not shapes question domains: pass --data with your texts")
    items = [it for d in adapters for it in domain_items(d, n, seed=seed, split=split)]
    if len(adapters) >= 2:
        items += mixed_items(n if n_mixed is None else n_mixed, seed=seed, split=split, domains=adapters)
    return [encode_item(tok, it) for it in items]


def picture_requests(tok: UnifiedTokenizer, n: int, seed: str) -> list[EncodedItem]:
    """`n` picture requests (models/families/shapes/styles.py, train split) as the words a picture follows: <bos>,
    the sentence, <boi>; no answer, so every position is context (label: the base expert)."""
    vocab = tok.vocab
    items = []
    for it in style_items(n, seed=seed, split="train"):
        ids = [vocab.bos_id, *tok.encode_text(it.prompt), vocab.boi_id]
        items.append(EncodedItem(ids, len(ids), [], "picture request"))
    return items


# --- validation --------------------------------------------------------------------------------------------

class GateAgreement:
    """Routing agreement of every block's top-1 with the labels, added up over batches: on the positions that
    predict an answer id, at the span starts among them (`span_starts`), and the share of prompt positions sent to
    the base expert (index `base_expert`, None when the gates have none)."""

    def __init__(self, num_blocks: int, base_expert: int | None) -> None:
        self.agree, self.agree_starts, self.to_base = (torch.zeros(num_blocks) for _ in range(3))
        self.answers = self.starts = self.context = 0
        self.base_expert = base_expert

    def add(self, batch, decisions: dict) -> None:
        answers = answer_positions(batch).reshape(-1)
        starts = span_starts(batch).reshape(-1)
        context = context_positions(batch).reshape(-1)
        for block, ds in decisions.items():
            top1 = ds[0].topk[:, 0]
            right = top1 == batch.labels.reshape(-1)
            self.agree[block] += float(right[answers].sum())
            self.agree_starts[block] += float(right[starts].sum())
            if self.base_expert is not None:
                self.to_base[block] += float((top1[context] == self.base_expert).sum())
        self.answers += int(answers.sum())
        self.starts += int(starts.sum())
        self.context += int(context.sum())

    def metrics(self) -> dict:
        """agreement_per_block, agreement (their mean), agreement_span_starts, context_to_base (with a base
        expert); empty before any answer position was counted."""
        if not self.answers:
            return {}
        per_block = (self.agree / self.answers).tolist()
        out = {"agreement_per_block": [round(a, 4) for a in per_block],
               "agreement": round(sum(per_block) / len(per_block), 4),
               "agreement_span_starts": round(float(self.agree_starts.mean()) / max(1, self.starts), 4)}
        if self.base_expert is not None and self.context:
            out["context_to_base"] = round(float(self.to_base.mean()) / self.context, 4)
        return out


@torch.no_grad()
def validate(routed: RoutedModel, router: LearnedRouter | None, data: list[EncodedItem], pad: int,
             adapters: list[str], batch_size: int = 64) -> dict:
    """Exact match per kind (domain / mixed) and, with learned gates, their routing agreement (`GateAgreement`)."""
    hits: dict[str, list[bool]] = {}
    base = len(adapters) if router is not None and router.gates.base_expert else None
    agreement = GateAgreement(routed.num_blocks, base)
    device = routed.device
    for i in range(0, len(data), batch_size):
        batch = make_batch(data, range(i, min(i + batch_size, len(data))), pad, adapters, device)
        out = routed(batch.ids, routers=router, use_cache=False)
        whole, _ = exact_matches(out.logits, batch, data)
        for r, ok in zip(batch.rows, whole):
            hits.setdefault(data[r].kind, []).append(ok)
        if out.decisions:
            agreement.add(batch, out.decisions)
    metrics = {f"exact_{k}": round(sum(v) / len(v), 4) for k, v in sorted(hits.items())}
    every = [x for v in hits.values() for x in v]
    metrics["exact_all"] = round(sum(every) / max(1, len(every)), 4)
    return {**metrics, **agreement.metrics()}


# --- training ----------------------------------------------------------------------------------------------

def answer_positions(batch) -> torch.Tensor:
    """[B, T] bool: positions that predict a scored answer id (position t predicts id t + 1)."""
    sel = torch.zeros_like(batch.target)
    sel[:, :-1] = batch.target[:, 1:]
    return sel & (batch.labels >= 0)


def context_positions(batch) -> torch.Tensor:
    """[B, T] bool: real positions that predict a prompt id (context, no domain)."""
    return batch.valid & (batch.labels < 0)


def span_starts(batch) -> torch.Tensor:
    """[B, T] bool: answer positions whose label differs from the position before (the first answer position,
    and each later span's first prediction): where a gate must switch adapters."""
    before = torch.cat([torch.full_like(batch.labels[:, :1], -1), batch.labels[:, :-1]], dim=1)
    return answer_positions(batch) & (batch.labels != before)


def label_loss(decisions: dict, batch, base_expert: int | None, start_weight: float = 1.0) -> torch.Tensor:
    """Cross-entropy of every block's gate logits against the domain labels on the positions that predict an
    answer id, and against the base expert (index `base_expert`, when there is one) on context positions. The
    two kinds count equally: a prompt has ten times more positions than its answer, and a gate fitted to the
    plain mean learns "base everywhere". Within the answer positions, span starts weigh `start_weight`: a
    request's first answer position must pick its FIRST question's domain while the words just read ask the
    second, which a gate fitted to the plain mean gets wrong (benchmarks/RESULTS.md, issue 12)."""
    answer = answer_positions(batch).reshape(-1)
    weight = torch.where(span_starts(batch).reshape(-1), start_weight, 1.0)
    groups = [(answer, batch.labels.reshape(-1), weight)]
    if base_expert is not None:
        context = context_positions(batch).reshape(-1)
        groups.append((context, torch.full_like(context, base_expert, dtype=torch.long), torch.ones_like(weight)))
    losses = []
    for keep, target, w in groups:
        if not bool(keep.any()):
            continue
        for ds in decisions.values():
            for d in ds:
                ce = F.cross_entropy(d.logits[keep], target[keep], reduction="none")
                losses.append((ce * w[keep]).sum() / w[keep].sum())
    return torch.stack(losses).mean()


def train_gates(routed: RoutedModel, tok: UnifiedTokenizer, adapters: list[str], train: list[EncodedItem],
                val: list[EncodedItem], args: argparse.Namespace) -> tuple[LearnedGates, dict]:
    torch.manual_seed(args.seed)
    gates = LearnedGates.for_model(routed, adapters, base_expert=args.base_expert, context_decays=args.context_decays)
    if args.init_from is not None:
        old = LearnedGates.load(args.init_from, device=routed.device)
        gates = old.with_adapters(adapters)  # the loaded gates' context decays and base expert, not the flags'
        if (list(old.context_decays), old.base_expert) != (list(args.context_decays), args.base_expert):
            log.warning("--init-from %s: its gates read context decays %s (base expert: %s); they are kept, "
                        "--context-decays / --base-expert are ignored", args.init_from, list(old.context_decays),
                        old.base_expert)
        if args.train_new_only:
            frozen = torch.tensor([n is None or n in old.adapters for n in gates.experts], device=routed.device)
            for gate in gates.gates:
                gate.weight.register_hook(lambda g: g.masked_fill(frozen[:, None], 0.0))
    router = LearnedRouter(gates, top_k=min(args.top_k, gates.num_experts), vocab=tok.vocab)
    base_index = len(adapters) if gates.base_expert else None
    opt = torch.optim.AdamW(gates.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = Schedule(args.steps, max(1, args.steps // 10), args.max_minutes)
    rng = random.Random(f"{args.seed}:router-order")
    pad = tok.vocab.pad_id
    order: list[int] = []
    step, curve, history = 0, [], []
    bar = tqdm(total=args.steps, desc="router", mininterval=5)
    while not sched.done(step):
        if len(order) < args.batch_size:
            order += rng.sample(range(len(train)), len(train))
        rows, order = order[:args.batch_size], order[args.batch_size:]
        batch = make_batch(train, rows, pad, adapters, routed.device)
        for group in opt.param_groups:
            group["lr"] = args.lr * sched.factor(step)
        out = routed(batch.ids, routers=router, use_cache=False)
        nll = answer_loss(out.logits, batch)
        loss = nll + args.lb_coef * out.load_balance_loss + args.z_coef * out.z_loss
        if args.label_coef > 0 and bool(answer_positions(batch).any()):
            loss = loss + args.label_coef * label_loss(out.decisions, batch, base_index, args.start_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % 10 == 0 or step == args.steps:
            curve.append((step, round(nll.item(), 4), round(out.load_balance_loss.item(), 4),
                          round(out.z_loss.item(), 3)))
            bar.set_postfix(nll=f"{curve[-1][1]:.3f}", lb=f"{curve[-1][2]:.3f}")
        if args.val_every and step % args.val_every == 0 and not sched.done(step):
            history.append({"step": step, **validate(routed, router, val, pad, adapters)})
            log.info("step %d: %s", step, history[-1])
    bar.close()
    metrics = {}
    for k in sorted({1, min(2, gates.num_experts)}):
        m = validate(routed, LearnedRouter(gates, top_k=k, vocab=tok.vocab), val, pad, adapters)
        metrics[f"top{k}"] = m
    log.info("validation: %s", metrics)
    return gates, {"steps": step, "curve": curve, "history": history, "val": metrics}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.train_new_only and args.init_from is None:
        raise SystemExit("--train-new-only needs --init-from (the gates whose rows stay as they are)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    adapters = list(dict.fromkeys(args.adapters))
    routed, tok = load_routed(args.model_dir, args.adapters_dir, adapters, args.device)
    if args.data is not None:
        data = read_jsonl(args.data, tok, adapters)
        if args.val_data is not None:
            train, val = data, read_jsonl(args.val_data, tok, adapters)
        else:
            order = random.Random(f"{args.seed}:split").sample(range(len(data)), len(data))
            cut = max(1, len(data) // 10)
            val, train = [data[i] for i in order[:cut]], [data[i] for i in order[cut:]] or [data[order[0]]]
        source = {"data": str(args.data), "val_data": str(args.val_data) if args.val_data else "10% of data"}
    else:
        n_mixed = args.n_per_domain if args.n_mixed is None else args.n_mixed
        train = shapes_data(tok, adapters, args.n_per_domain, f"router{args.seed}", "train", n_mixed)
        train += picture_requests(tok, args.picture_requests, f"router{args.seed}")
        val = shapes_data(tok, adapters, args.n_val, f"router-val{args.seed}", "heldout")
        source = {"data": "models/families/shapes/domains.py", "n_per_domain": args.n_per_domain, "n_mixed": n_mixed,
                  "n_val": args.n_val, "picture_requests": args.picture_requests}
    log.info("router over %s: %d train, %d val records", adapters, len(train), len(val))
    gates, result = train_gates(routed, tok, adapters, train, val, args)
    args.out.mkdir(parents=True, exist_ok=True)
    gates.save(args.out / "gates.safetensors")
    config = {"format": "molora-router", "version": GATES_FORMAT_VERSION, "adapters": adapters,
              "base_expert": gates.base_expert, "context_decays": list(gates.context_decays),
              "top_k": args.top_k, "d_model": gates.d_model,
              "num_blocks": gates.num_blocks, "hierarchical": "text positions gated; image positions by vocabulary",
              "loss": {"next_token": 1.0, "load_balance": args.lb_coef, "z": args.z_coef, "label": args.label_coef,
                       "label_start_weight": args.start_weight},
              "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed,
              "init_from": str(args.init_from) if args.init_from else None, "train_new_only": args.train_new_only,
              "train_records": len(train),
              "val_records": len(val), **source, "adapter_sha256_16": file_hashes(args.adapters_dir, adapters),
              "seconds": round(time.time() - t0, 1), "device": device_name(args.device), "threads": args.threads,
              "torch": torch.__version__, **result}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    return config


if __name__ == "__main__":
    main()
