"""A peer's drafter judged by our harness (issue 31): SpecForge's DFlash, trained by
SpecForge's own trainer on our collection, replayed losslessly beside our drafters on the
same held-out turns.

    python -m jobs.benchmark peers --config configs/experiments/smollm2.yaml --out FILE
        [--shards DIR] [--drafter NAME=DIR ...] [--work-dir DIR] [key=value ...]

Steps (each reused when finished in the work directory, `<run.output_dir>/peers` unless
--work-dir): (1) our shards -> SpecForge's offline `.ckpt` layout and SpecForge's DFlash
trained and exported (`peers_train`); (2) the check against SpecForge's own decode loop
on >= 20 held-out prompts (`peers_check`: same accepted length every round, both outputs
equal plain greedy); (3) the evaluation stage over `specforge_dflash` and our drafters
(--drafter, default: this config's finished align stage) plus `eval.baselines`, prompt
lookup and SuffixDecoding always among them: tau by
bucket, draft ms per round and drafter cache bytes by bucket, speedup, lossless.
--shards defaults to this config's finished collect stage (`storage_mode: full`).
Needs the optional extra: `pip install -e ".[peers]"` then `pip install specforge==0.2.0
--no-deps` (SpecForge pins torch 2.11 / transformers 5.8.1 / sglang; its offline path
imports none of what --no-deps leaves out)."""

import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from dlite.config_schema import BASELINES

CHECK_PROMPTS, CHECK_NEW_TOKENS, CHECK_MAX_CONTEXT = 20, 32, 2048


def _finished(cfg, stage: str):
    from pipelines.orchestration.dag import plan
    s = next((s for s in plan(cfg) if s.name == stage), None)
    if s is None or s.status not in ("done", "reuse"):
        raise SystemExit(f"peers: no finished {stage} stage for this config "
                         f"({s.dir if s else 'not in run.stages'}): run the pipeline first or pass "
                         f"{'--shards' if stage == 'collect' else '--drafter NAME=DIR'}")
    return Path(s.dir)


def _ours(cfg, specs) -> dict:
    if specs:
        return dict(spec.split("=", 1) if "=" in spec else ("dlite", spec) for spec in specs)
    return {"dlite": str(_finished(cfg, "align") / "drafter")}


def check_prompts(cfg, tok, n: int = CHECK_PROMPTS) -> list:
    """n held-out prompts for the loop check: every turn of the held-out trajectories up
    to CHECK_MAX_CONTEXT tokens (three prefills each, on 2 cores), spread over them; more
    held-out trajectories than the evaluation's when its own hold fewer such turns."""
    from pipelines.stages.evaluate_throughput import heldout_turns
    return heldout_turns(cfg, tok, n, 0, CHECK_MAX_CONTEXT, reads=(8, 16, 32))


def loop_check(cfg, export: Path, n: int) -> dict:
    """peers_check.compare on the configured target (eval.threads threads)."""
    import torch
    from dlite import target as tgt
    from dlite.export import load_drafter
    from pipelines.benchmarks.peers_check import compare
    torch.set_num_threads(int(cfg.eval.threads))
    model, tok = tgt.load(cfg.target)
    embed, lm_head, _ = tgt.shared_vocab(model, tok)
    drafter = load_drafter(export, embed, lm_head)
    t0 = time.time()
    out = compare(export, model, drafter, check_prompts(cfg, tok, n), CHECK_NEW_TOKENS, tgt.eos_ids(model, tok))
    return {**out, "max_new_tokens": CHECK_NEW_TOKENS, "seconds": round(time.time() - t0, 1)}


def _rows(report: dict) -> dict:
    keys = ("tau", "tau_by_bucket", "draft_ms_by_bucket", "draft_cache_bytes_by_bucket",
            "speedup_vs_ar", "speedup_vs_ar_by_bucket", "lossless", "n_rounds")
    return {name: {k: m.get(k) for k in keys} for name, m in report["methods"].items()}


def with_training_free(cfg):
    """The config with prompt lookup and SuffixDecoding among `eval.baselines`: the
    peer's row sits beside the training-free methods as well as our drafters."""
    have = list(cfg.eval.baselines)
    return OmegaConf.merge(cfg, {"eval": {"baselines": have + [b for b in BASELINES if b not in have]}})


def run(cfg, args) -> dict:
    from transformers import AutoConfig
    from dlite import target as tgt
    from dlite.envinfo import env_info
    from pipelines.benchmarks import peers_train
    from pipelines.benchmarks.peers_check import PATCHES
    from pipelines.stages.evaluate import evaluate_stage
    t0 = time.time()
    work = Path(args.work_dir or Path(cfg.run.output_dir) / "peers").resolve()
    shards = args.shards or str(_finished(cfg, "collect") / "shards")
    ours = _ours(cfg, args.drafter)
    tdir = str(tgt.target_dir(cfg.target))
    tc, tok = AutoConfig.from_pretrained(tdir), tgt.load_tokenizer(cfg.target)
    trained = peers_train.train(cfg, shards, work / "dflash", tdir, tok, tc.num_hidden_layers,
                                tc.vocab_size, tgt.eos_ids(tc, tok))
    export = Path(trained["export"])
    peers_train.stamp_lineage(export, {"target_fingerprint": tgt.fingerprint(cfg.target)["id"],
                                       "target_name": cfg.target.name, "dlite_shards": shards})
    check_file = work / "loop_check.json"
    if not check_file.is_file():
        check_file.write_text(json.dumps(loop_check(cfg, export, CHECK_PROMPTS), indent=2))
    check = json.loads(check_file.read_text())
    report = evaluate_stage(with_training_free(cfg), {**ours, "specforge_dflash": str(export)},
                            work / "evaluate")
    rows = _rows(report)
    dl, df = rows.get(next(iter(ours))), rows.get("specforge_dflash")
    return {"methods": rows, "primary": next(iter(ours)),
            "dlite_over_dflash_tau_by_bucket": _ratio_by_bucket(dl, df, "tau_by_bucket"),
            "dlite_over_dflash_draft_ms_by_bucket": _ratio_by_bucket(dl, df, "draft_ms_by_bucket"),
            "specforge_training": trained, "loop_check": {k: v for k, v in check.items() if k != "rows"},
            "loop_check_rows": check["rows"], "specforge_version": _version(),
            "specforge_patches": PATCHES, "shards": shards, "ours": ours, "work_dir": str(work),
            "seconds": round(time.time() - t0, 1),
            "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}


def _version() -> str:
    from importlib.metadata import version
    return version("specforge")


def _ratio_by_bucket(a: dict, b: dict, key: str) -> dict:
    from pipelines.benchmarks.settings import ratio
    if not a or not b:
        return {}
    return {k: ratio(v, (b.get(key) or {}).get(k)) for k, v in (a.get(key) or {}).items()}
