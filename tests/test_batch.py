"""Batch generation (`molora generate --prompts FILE --out DIR`, models/batch.py): the prompts file's rules, one page
and one record per prompt, a refused prompt recorded without losing the others, and the same documents from two
data-parallel processes as from one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molora.models.batch import PromptFileError, read_prompts
from molora.models.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent


def test_a_jsonl_line_sets_its_own_seed_and_options_and_others_count_from_the_base_seed(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a red circle", "start_image": true}\n\n'
                    '{"prompt": "two stars", "seed": 7, "image_adapter": "outline"}\n{"prompt": ""}\n')
    items = read_prompts(path, base_seed=100)
    assert [(i.index, i.prompt, i.seed) for i in items] == [(0, "a red circle", 100), (1, "two stars", 7),
                                                           (2, "", 102)]
    assert items[0].options == {"start_image": True} and items[1].options == {"image_adapter": "outline"}


def test_a_text_file_is_one_prompt_a_line(tmp_path: Path):
    path = tmp_path / "p.txt"
    path.write_text("Draw a red circle.\n\n  A story about shapes:  \n")
    assert [(i.prompt, i.seed) for i in read_prompts(path)] == [("Draw a red circle.", 0),
                                                               ("A story about shapes:", 1)]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\n{"prompt": 3}\n', "p.jsonl:2: a line must be an object"),
    ('{"prompt": "a"\n', "p.jsonl:1: not a JSON object"),
    ('["a"]\n', "p.jsonl:1: a line must be an object"),
    ('{"prompt": "a", "temprature": 1}\n', "unknown keys ['temprature']"),
    ('{"prompt": "a", "seed": -1}\n', "seed"),
    ('{"prompt": "a", "seed": "7"}\n', "seed"),
    ("\n\n", "holds no prompts"),
])
def test_a_bad_prompts_file_is_refused_naming_the_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(PromptFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_prompts(path)


def test_an_unreadable_prompts_file_is_a_project_error(tmp_path: Path):
    with pytest.raises(PromptFileError, match="cannot read the prompts file"):
        read_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PromptFileError, match="cannot read the prompts file"):
        read_prompts(tmp_path / "bin.txt")


def test_the_cli_writes_a_page_and_a_record_per_prompt_and_keeps_going_past_a_refused_one(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red circle"}\n{"prompt": "a picture", "start_image": true}\n'
                       '{"prompt": "two stars", "seed": 5}\n')
    out = tmp_path / "docs"
    code = cli_main(["--prompts", str(prompts), "--out", str(out), "--model", str(tiny_model_dir),
                     "--max-new-tokens", "6", "--device", "cpu"])
    assert code == 1  # one prompt was refused: the run says so in its exit status
    records = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert "start_image needs max_new_tokens" in records[1]["error"]
    assert [r["seed"] for r in records] == [0, 1, 5]
    for record in (records[0], records[2]):
        assert (out / record["html"]).is_file() and len(record["token_ids"]) == len(record["adapters"]) > 0
    summary = json.loads((out / "run.json").read_text())
    assert summary["documents"] == 2 and summary["failed"][0]["index"] == 1 and summary["processes"] == 1
    assert [(p["documents"], p["failed"]) for p in summary["per_process"]] == [(2, 1)]  # the top's count, per process
    assert summary["tokens"] == sum(len(r.get("token_ids", ())) for r in records)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert not list(out.glob("shard-*"))


@pytest.mark.parametrize("argv, message", [
    (["a prompt", "--prompts", "p.txt"], "not both"),
    ([], "not both and not neither"),
    (["--prompts", "p.txt", "--out", "doc.html"], "give --out a directory"),
    (["--prompts", "p.txt"], "give --out a directory"),
    (["a prompt", "--out", "."], "--out . is a directory; give the HTML file to write"),
    (["a prompt", "--out", "p.txt/doc.html"], "p.txt is a file, not a directory"),
    (["a prompt", "--markdown", "p.txt"], "--markdown p.txt is a file"),
])
def test_the_cli_refuses_a_prompt_and_a_file_or_a_page_for_a_batch(argv: list[str], message: str,
                                                                    capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a prompt\n")
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.html"))


def test_two_data_parallel_processes_write_the_documents_of_one(tiny_model_dir: Path, tmp_path: Path):
    """torchrun (what `accelerate launch` runs on GPUs) with two CPU processes: each takes half the prompts on its
    own pipeline; every document equals the one-process run's (each prompt has its own seed)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(5)))
    common = ["-m", "molora", "generate", "--prompts", str(prompts), "--model", str(tiny_model_dir),
              "--max-new-tokens", "8", "--device", "cpu", "--seed", "11"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOLORA_THREADS": "1"}
    one = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "one")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *common, "--out", str(tmp_path / "two")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr
    read = lambda d: [json.loads(line) for line in (tmp_path / d / "documents.jsonl").read_text().splitlines()]  # noqa: E731
    assert read("two") == read("one")
    summary = json.loads((tmp_path / "two" / "run.json").read_text())
    assert summary["processes"] == 2 and [p["documents"] for p in summary["per_process"]] == [3, 2]


def test_the_cli_refuses_an_out_directory_before_generating(tiny_model_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch):
    import molora.models.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("the model was loaded before --out was checked"))
    assert cli_main(["a prompt", "--out", str(tmp_path), "--model", str(tiny_model_dir)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_the_cli_says_when_it_cut_a_prompt_to_fit_the_model(tiny_model_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture):
    out = tmp_path / "long.html"
    code = cli_main(["a red circle in the top left " * 400, "--out", str(out), "--model", str(tiny_model_dir),
                     "--max-new-tokens", "6", "--max-images", "0", "--device", "cpu", "--seed", "0"])
    assert code == 0 and out.is_file()
    assert "note: the prompt has" in capsys.readouterr().err and "were kept" in out.read_text()
