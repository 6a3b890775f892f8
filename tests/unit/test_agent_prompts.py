"""`data.extra_prompts`: prompt lines become one-user-turn conversations for the
regenerate stage (whose reader keeps them; a broken line is quarantined with its reason),
joined to the built-in corpus' input file; the key is checked before any work (missing
file, regeneration off, a user train_path) and names itself. The real SWE-bench prompts
are used when /work/shared/data is there, else those tests skip."""

import json
from pathlib import Path

import pytest

from dlite.config import ConfigError, load_config
from dlite.corpus import build
from dlite.data import formats
from pipelines.stages.collect import _prepare, _resolve_input

SWE_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "swe-bench-prompts.jsonl"
needs_shared = pytest.mark.skipif(not SWE_PROMPTS.is_file(), reason="no /work/shared/data here")


def _prompts(tmp_path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join([json.dumps({"turns": ["Fix the parser.", "and a follow-up"]}),
                            json.dumps({"id": "x9", "turns": ["Add a flag."]}), "",
                            "{not json", json.dumps({"turns": []})]) + "\n")
    return p


def test_prompt_lines_convert_and_pass_bad_lines_on(tmp_path):
    lines = build.prompt_lines(_prompts(tmp_path))
    assert json.loads(lines[0]) == {"id": "prompt-1", "messages": [{"role": "user", "content": "Fix the parser."}]}
    assert json.loads(lines[1])["id"] == "prompt-x9"
    assert lines[2] == "{not json" and json.loads(lines[3]) == {"turns": []}
    assert len(build.prompt_lines(_prompts(tmp_path), limit=1)) == 1


def test_the_regenerate_reader_keeps_prompts_and_quarantines_bad_lines(tmp_path):
    cfg = load_config("configs/experiments/tiny.yaml", [
        "data.regenerate=true", f"data.extra_prompts={_prompts(tmp_path)}", "data.n_train=2"])
    path = _resolve_input(cfg, "builtin:train", str(tmp_path / "out"))
    assert "-p" in Path(path).name and len(Path(path).read_text().splitlines()) == 2 + 4
    specs, _ = formats.plan_input(path, per_shard=16)
    got = json.loads(_prepare({"spec": [json.dumps(specs[0])]}, [], False)["payload"][0])
    assert got["read"] == 6 and len(got["records"]) == 4
    assert [r["id"] for r in got["records"][2:]] == ["prompt-1", "prompt-x9"]
    assert sorted(q["reason"] for q in got["quarantine"]) == ["bad_json", "empty_conversation"]
    held = _resolve_input(cfg, "builtin:heldout", str(tmp_path / "out"))
    assert "-p" not in Path(held).name  # prompts join training only


@pytest.mark.parametrize("over,match", [
    (["data.regenerate=true", "data.extra_prompts=/no/such/prompts.jsonl"], "data.extra_prompts: no such file"),
    (["data.extra_prompts={p}"], "data.extra_prompts: needs data.regenerate"),
    (["data.regenerate=true", "data.extra_prompts={p}", "data.train_path=/x"], "data.extra_prompts: joins"),
    (["data.extra_prompts_limit=-1"], "data.extra_prompts_limit")])
def test_bad_extra_prompts_fail_before_any_work(tmp_path, over, match):
    over = [o.format(p=_prompts(tmp_path)) for o in over]
    with pytest.raises(ConfigError, match=match):
        load_config("configs/experiments/tiny.yaml", over)


@needs_shared
def test_the_shared_swe_bench_prompts(tmp_path):
    lines = build.prompt_lines(SWE_PROMPTS, limit=5)
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 5 and all(r["messages"][0]["content"].startswith("Problem Statement") for r in recs)
    cfg = load_config("configs/experiments/tiny.yaml", [
        "data.regenerate=true", f"data.extra_prompts={SWE_PROMPTS}", "data.extra_prompts_limit=5"])
    assert cfg.data.extra_prompts_limit == 5
