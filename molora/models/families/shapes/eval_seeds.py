"""Which held-out seeds are test seeds, and which ones choices were made on (issue 29).

The held-out items of an evaluation are drawn from a seed (domains.domain_items / mixed_items, styles.style_items):
another seed, other items. A number is held out only if nothing was chosen on its seed's items. These seeds were:

    eval             scripts/eval_molora.py's and eval_image_styles.py's only seed until issue 29: router and
                     image-gate variants were chosen on its items. It stays the VALIDATION seed: choose on it.
    eval-first       the first pictures of eval_image_styles.py's second-picture rows at seed "eval"
    val<N>           train_domain_adapters / train_image_adapter / train_image_router validation (seed N)
    router-val<N>    train_router.py validation (its mixed requests are mixed_items(seed="router-val<N>"))
    ad-val<N>, probe-val   train_adapters.py and probe_gates.py validation

Any other seed (e.g. 1, 2, 3) is a test seed: report on it, never choose on it.

    is_selection_seed(seed) -> bool
    check_seeds(seeds) -> (seeds, held_out)   ShapesError for a selection seed pooled with test seeds
    selection_warning(seeds) -> str           what a report on selection seeds says first
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import ShapesError

VALIDATION_SEED = "eval"
_SELECTION = re.compile(r"eval|eval-first|(router-|ad-)?val\d*|probe-val")


def is_selection_seed(seed: int | str) -> bool:
    """True for a seed some choice was made on (its items are not held out from the project's choices)."""
    return _SELECTION.fullmatch(str(seed).strip().lower()) is not None


def check_seeds(seeds: Sequence[int | str]) -> tuple[list[str], bool]:
    """(the seeds as strings, held_out): held_out is False when they are selection seeds (the report must say so).
    ShapesError for a selection seed among test seeds (a pooled number would be partly not held out) or a seed
    given twice (the same items pooled twice would narrow the intervals falsely)."""
    out = [str(s).strip() for s in seeds]
    if not out:
        raise ShapesError("give at least one seed")
    if len(set(out)) != len(out):
        raise ShapesError(f"seed given twice in {out}: the same items pooled twice would narrow the intervals falsely")
    chosen = [s for s in out if is_selection_seed(s)]
    if chosen and len(chosen) != len(out):
        raise ShapesError(f"seeds {chosen} were used to choose between models and {[s for s in out if s not in chosen]} "
                          "were not: run them separately; a pooled number would be partly not held out")
    return out, not chosen


def selection_warning(seeds: Sequence[str]) -> str:
    """The line a report opens with when its seeds are selection seeds."""
    return (f"NOT HELD OUT: seed(s) {list(seeds)} chose between models (molora/models/families/shapes/eval_seeds.py); "
            "use these numbers to choose, report test seeds (any other, e.g. --seed 1 2 3)")


__all__ = ["VALIDATION_SEED", "check_seeds", "is_selection_seed", "selection_warning"]
