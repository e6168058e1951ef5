"""Train the byte-level BPE text tokenizer on the shapes world's text and lay out the unified vocabulary.

Corpus: captions in both registers (plain, pirate), instructions and interleaved documents, so the same
tokenizer serves the base model and the text-style adapter.  The image range is sized from the VQ codebook;
one row marker per image row follows it (`--no-row-markers` leaves them out): a code then knows its row from the
nearest marker before it, instead of counting its distance to <boi>.
Writes tokenizer.json and vocab.json into the model directory.

    python scripts/train_tokenizer.py --out assets/model --vq assets/model/vq
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molora.models.families.shapes.data import text_corpus  # noqa: E402
from molora.models.families.shapes.tokenizer import UnifiedTokenizer  # noqa: E402

log = logging.getLogger("train_tokenizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="model directory to write tokenizer.json/vocab.json")
    p.add_argument("--vq", type=Path, help="VQModel directory: the image range is its codebook size")
    p.add_argument("--image-size", type=int, default=512, help="codebook size when --vq is not given")
    p.add_argument("--text-vocab", type=int, default=768, help="BPE ids incl. 5 specials and 256 bytes")
    p.add_argument("--row-markers", action=argparse.BooleanOptionalAction, default=True,
                   help="a marker id after each image row (UnifiedVocab.row_end_ids)")
    p.add_argument("--n-examples", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> UnifiedTokenizer:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.time()
    image_size = args.image_size
    if args.vq is not None:
        image_size = json.loads((args.vq / "config.json").read_text())["num_vq_embeddings"]
    corpus = text_corpus(args.n_examples, seed=f"tok{args.seed}", workers=args.workers)
    tok = UnifiedTokenizer.train(corpus, text_vocab_size=args.text_vocab, image_size=image_size,
                                 row_markers=args.row_markers)
    tok.save(args.out)
    n_ids = sum(len(ids) for ids in tok.encode_batch(corpus))
    n_words = sum(len(t.split()) for t in corpus)
    log.info("%s from %d texts in %.1fs; %.2f ids per word", tok, len(corpus), time.time() - t0, n_ids / n_words)
    return tok


if __name__ == "__main__":
    main()
