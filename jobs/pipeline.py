"""The main job: `python -m jobs.pipeline --config FILE [--dry-run] [key=value ...]`.

Validates the config, prints the plan, then runs the stages this version has. Today
that is `prepare`: verify the target (load it, fingerprint it, greedy-generate from a
held-out trajectory) and write the built-in corpus splits the later stages read. The
collect → teacher → align/dspark → evaluate → publish stages join as they land.
"""

import json
import sys
import time
from pathlib import Path

from jobs.cli import parse_args

# Stages the pipeline runs itself today; the others exist as their own jobs
# (`python -m jobs.collect|train|evaluate`, see the README) until the DAG wires them.
AVAILABLE = {"prepare"}
STANDALONE = {"collect": "jobs.collect", "teacher": "jobs.train", "align": "jobs.train",
              "dspark": "jobs.train", "evaluate": "jobs.evaluate"}


def plan(cfg) -> list[dict]:
    stages = ["prepare", *cfg.run.stages]
    def note(s):
        if s in AVAILABLE:
            return ""
        if s in STANDALONE:
            return f"not wired into the pipeline yet: run python -m {STANDALONE[s]}"
        return "not implemented yet"
    return [{"stage": s, "runs": s in AVAILABLE, "note": note(s)} for s in stages]


def prepare(cfg, out: Path) -> dict:
    """Verify the target end to end and materialise the corpus splits as JSONL."""
    import torch
    from dlite import target
    from dlite.tiny import corpus
    from dlite.tiny.tokenizer import render
    t0 = time.time()
    model, tok = target.load(cfg.target)
    fp = target.fingerprint(cfg.target)
    d = cfg.data
    paths = {}
    for split, n in (("train", d.n_train), ("heldout", d.n_heldout)):
        recs = corpus.generate(split, n, cfg.run.seed, d.min_chars, d.max_chars)
        paths[split] = str(out / f"{split}.jsonl")
        corpus.write_jsonl(recs, paths[split])
    first = json.loads(Path(paths["heldout"]).read_text().splitlines()[0])
    # Generate the final assistant turn from its full history: the target must run.
    prompt = render(tok, {**first, "messages": first["messages"][:-1]}, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, do_sample=False)
    return {"target_fingerprint": fp, "n_params": model.num_parameters(), "corpus": paths,
            "prompt_tokens": ids.shape[1], "sample": tok.decode(gen[0, ids.shape[1]:]),
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    args, cfg = parse_args(argv)
    from dlite.config import config_hash, to_yaml
    out = Path(cfg.run.output_dir) / f"{cfg.run.name}-{config_hash(cfg)}"
    steps = plan(cfg)
    print(f"[pipeline] config {args.config} (hash {config_hash(cfg)}) -> {out}")
    for s in steps:
        print(f"[pipeline]   {s['stage']:<9} {'run' if s['runs'] else 'skip: ' + s['note']}")
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    summary = {"config_hash": config_hash(cfg), "output_dir": str(out), "plan": steps,
               "prepare": prepare(cfg, out)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["prepare"], indent=2))
    print(f"[pipeline] done: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
