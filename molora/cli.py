"""The `molora` command: one entry point for the package's command lines.

    molora generate "Draw a red circle." --out out/doc.html           # one document (models/cli.py)
    molora generate --prompts prompts.jsonl --out out/docs/           # a batch; data-parallel under accelerate launch
    molora evaluate --n 200 --out shapes_eval.md                      # ShapesEval on the embedded model
    molora serve --port 7860                                          # the Gradio demo (what app.py runs)

From a source checkout without installing, `python -m molora ...` is the same command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _generate(argv: list[str]) -> int:
    from molora.models.cli import main
    return main(argv)


def _evaluate(argv: list[str]) -> int:
    from molora.models.families.shapes.eval import main
    return main(argv)


def _serve(argv: list[str]) -> int:
    from molora.app.server import main
    main(argv)
    return 0


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "generate": (_generate, "write documents of text and images (one prompt, or a file of prompts)"),
    "evaluate": (_evaluate, "score a model on held-out ShapesEval scenes"),
    "serve": (_serve, "run the Gradio demo in a browser"),
}


def usage() -> str:
    lines = ["usage: molora {" + ",".join(COMMANDS) + "} [options]   (molora COMMAND --help for a command's options)",
             "", "commands:"]
    lines += [f"  {name:<10}{summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] not in COMMANDS:
        print(f"molora: unknown command {args[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    run, _ = COMMANDS[args[0]]
    return run(args[1:])
