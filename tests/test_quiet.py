"""A library is quiet unless asked: loading and generating print nothing when logging is not configured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from molora.models import InterleavedPipeline
pipe = InterleavedPipeline.from_pretrained(sys.argv[1], device="cpu")
doc = pipe.generate("Draw a red circle.", image_adapter="image_style", routing="vocab", seed=0,
                    start_image=True, max_new_tokens=pipe.vocab.tokens_per_image + 4)
assert doc.images
"""


def test_loading_and_generating_print_nothing(tiny_model_dir, tmp_path):
    """No "Loading weights" bar, no diffusers float32 warning, no per-call notices on stderr or stdout."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", out.stderr


def test_what_the_readme_and_the_cli_write_by_default_is_git_ignored():
    """The README's example writes out/circle.html and out/circle/; `molora generate` writes document.html."""
    paths = ["out/circle.html", "out/circle/document.md", "document.html"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True)
    assert sorted(ignored.stdout.split()) == sorted(paths)
