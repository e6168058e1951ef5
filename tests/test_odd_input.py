"""Odd input a new user sends (issue 30): every refusal is a MoLoRAError naming the problem, before any work."""

from __future__ import annotations

import json
import re

import pytest

from molora.models.batch import PromptFileError, read_prompts
from molora.models.cli import main as generate_main
from molora.models.engine.generation import GenerationConfig, PromptTextError
from molora.routing.errors import MoLoRAError


@pytest.mark.parametrize("prompt, found", [
    ("Draw a red \udcff\udcfe circle.", "bytes that are not UTF-8 (0xff 0xfe), the first at character 12"),
    ("Draw a red \ud800 circle.", "a lone UTF-16 surrogate (U+D800)"),
])
def test_a_prompt_that_is_not_text_is_refused_naming_the_bytes(tiny_pipeline, prompt, found):
    with pytest.raises(PromptTextError, match=re.escape(found)) as err:
        tiny_pipeline.generate(prompt, max_new_tokens=2, seed=0)
    assert isinstance(err.value, MoLoRAError)
    with pytest.raises(PromptTextError, match="part 2 of the prompt"):
        tiny_pipeline.generate(("fine", prompt), max_new_tokens=2, seed=0)
    with pytest.raises(PromptTextError, match="negative_prompt"):
        GenerationConfig(negative_prompt=prompt)


def test_the_command_line_refuses_bytes_that_are_not_utf8_before_loading_anything(capsys, monkeypatch):
    import molora.models.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded for a prompt that is refused"))
    # what Python makes of `molora generate $'Draw a red \xff\xfe circle.'`
    argv = ["Draw a red \udcff\udcfe circle.", "--out", "x.html"]
    assert generate_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the prompt holds 2 characters that are not text") and "Traceback" not in err


def test_a_prompts_file_line_that_is_not_text_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "bad \udcff"}) + "\n")
    with pytest.raises(PromptFileError, match=r"prompts.jsonl:2: the prompt holds a character that is not text"):
        read_prompts(path)
