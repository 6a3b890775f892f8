"""The evaluation stage on Ray: every drafter a run produced, the primary one over a
per-request vocabulary (`eval.context_vocab`), and the training-free methods and hybrids
`eval.baselines` / `eval.hybrids` name, against the real target, on the same held-out
prompts.

  acceptance  the held-out trajectories are split over `eval.num_workers` Ray tasks;
              each loads the target once and replays its records with every drafter
              at every temperature from one prefill per history (speculative per
              method, plain once per prompt and temperature, so greedy output is
              checked token for token); raw rounds come back and the driver aggregates them
              -> tau, accept_at_k, per-bucket figures, lossless
                 (strict, and up to the target's ties: `dlite.decoding.ties`)
  speed       afterwards, alone on the machine, ONE task replays the first
              `eval.speed_trajectories` records with every drafter, plain and
              speculative interleaved per prompt so machine noise cancels
              -> speedup_vs_ar, tokens/s, time split
Before both, the choose / tree hybrids' calibration is fitted on validation turns
(`pipelines.stages.evaluate_calibration`) and reported as `calibration`. After them,
with `eval.concurrency`, throughput at those concurrencies on one worker
(`pipelines.stages.evaluate_throughput`), reported as `throughput` with two plots.

Report (ARCHITECTURE.md §3): `{"methods": {name: report}, "primary": name, <the
primary method's metrics at top level>, "plain", "config", "env"}`; each method's
report is `dlite.decoding.replay.aggregate`'s, greedy at top level and every temperature
under `by_temperature`. `lossless` stays strict (token-identical); `lossless_rule` names
what the pipeline decides on: "exact" for an fp32 target, "up_to_ties(bf16)" (the
report's `lossless_up_to_ties`) for a bf16 one (`dlite.decoding.ties.lossless_verdict`).
"""

import json
from pathlib import Path
from typing import Dict, Optional

import ray
from omegaconf import OmegaConf

from pipelines.common.ray_cluster import init_ray
from pipelines.stages.evaluate_calibration import hybrid_calibration

# The order methods are listed, plotted and picked as primary in.
METHOD_ORDER = ("dlite", "dlite_no_teacher", "teacher", "dspark")
# Taken from the dedicated speed replay, not from the parallel acceptance replay.
SPEED_KEYS = ("speedup_vs_ar", "speedup_vs_ar_e2e", "speedup_vs_ar_by_bucket", "tokens_per_s", "time_split",
              "speedup_vs_ar_spread", "speedup_vs_ar_lower", "task_times")
REPORT = "report.json"
QUARANTINE_LISTED = 200  # quarantine entries the report lists (all are counted)


def heldout_set(cfg) -> tuple:
    """(the evaluation records, the held-out counts for the report): `data.heldout_path`
    in any format collection reads (`dlite.data.heldout`: unusable records quarantined
    with a reason, `read = used + quarantined`), or the built-in held-out split."""
    n = cfg.eval.n_trajectories
    if cfg.data.heldout_path:
        from dlite.data.heldout import read_heldout
        records, counts, bad = read_heldout(cfg.data.heldout_path, n, cfg.data.keep_reasoning)
        if not records:
            raise ValueError(f"data.heldout_path {cfg.data.heldout_path}: no usable record "
                             f"({counts['read']} read, quarantined {counts['reasons'] or 'none'})")
        return records, {"path": str(cfg.data.heldout_path), **counts, "quarantine": bad[:QUARANTINE_LISTED]}
    from dlite.corpus import build
    lo, hi = cfg.eval.min_chars or cfg.data.min_chars, cfg.eval.max_chars or cfg.data.max_chars
    records = build.heldout_records(cfg.data.corpus, n, cfg.run.seed, lo, hi)
    label = "builtin:heldout" if cfg.data.corpus == "builtin" else f"builtin:{cfg.data.corpus}-heldout"
    return records, {"path": label, "read": len(records), "used": len(records),
                     "quarantined": 0, "reasons": {}, "quarantine": []}


def heldout_records(cfg) -> list:
    """The evaluation trajectories (`heldout_set` without the counts)."""
    return heldout_set(cfg)[0]


def _artifact(drafter_dir) -> tuple:
    """(the artifact's config.json, its architecture: `dlite`, `dlite_v1`, `teacher` or
    `dspark`; older artifacts say `arch`, the oldest nothing: DLite; a directory in the
    authors' published layout is `dlite_v1`, a SpecForge DFlash export `specforge_dflash`)."""
    from dlite.models import dflash_peer, dlite_v1_io
    conf = json.loads((Path(drafter_dir) / "config.json").read_text())
    if dlite_v1_io.is_published(Path(drafter_dir)):
        return conf, "dlite_v1"
    if dflash_peer.is_dflash_export(Path(drafter_dir)):
        return conf, "specforge_dflash"
    return conf, conf.get("architecture", conf.get("arch", "dlite"))


def method_name(drafter_dir) -> str:
    """`dlite`, `dlite_no_teacher`, `teacher` or `dspark`, from the artifact's config.json."""
    conf, arch = _artifact(drafter_dir)
    return "dlite_no_teacher" if arch == "dlite" and conf.get("skip_teacher") else arch


def _load(cfg, drafters: Dict[str, str], threads: int) -> tuple:
    """(target, tokenizer, {name: loaded drafter}, vocab size) in this worker."""
    import torch
    from dlite import target as tgt
    from dlite.export import load_drafter
    # Acceptance workers share the cores, one thread each; the timed worker runs alone
    # with eval.threads (tiny targets time best single-threaded, SmolLM2 with 2).
    torch.set_num_threads(threads)
    model, tok = tgt.load(cfg.target)  # target.dtype / attn_implementation, as collected
    if torch.cuda.is_available():  # a GPU worker (cluster.use_gpu): target and drafters on it
        model = model.to("cuda")
    from dlite.target.layers import final_norm_weight
    embed, lm_head, _ = tgt.shared_vocab(model, tok)
    norm = final_norm_weight(model)  # read only by a drafter in the authors' published layout
    learned = {}
    for name, path in drafters.items():
        learned[name] = load_drafter(path, embed, lm_head, norm).to(model.dtype)  # the target's dtype
    return model, tok, learned, lm_head.shape[0]


def _replay_all(cfg_dict: dict, drafters: Dict[str, str], records: list, temperatures: list,
                threads: int = 1, timed: bool = False, calibration: dict = None) -> dict:
    """One worker: load the target once, replay `records` with every method (the learned
    drafters, then eval.baselines and eval.hybrids, those that score proposals with
    `calibration`) at every temperature, one prefill per history for all of them;
    `timed`: plain decoding interleaved with each method (the speed worker), else run
    once per prompt and shared (acceptance workers);
    {method: {temperature: (raw results, skipped turns)}}."""
    from dlite.decoding.methods import method_builders
    from dlite.decoding.replay import replay_methods
    cfg = OmegaConf.create(cfg_dict)
    model, tok, learned, vocab = _load(cfg, drafters, threads)
    builders = method_builders(cfg.eval, learned, vocab, calibration)
    return replay_methods(model, tok, builders, records, cfg.eval, temperatures, timed)[0]


def _timed_replay(cfg_dict: dict, drafters: Dict[str, str], records: list, temperatures: list,
                  threads: int, calibration: dict = None) -> tuple:
    """The speed worker: `_replay_all` timed, and where it ran -- the machine's load
    before and after (1-minute load average), cores, torch threads, CPU model: how much
    a verification saves depends on the machine and what else it runs, so a speedup is
    reported with the conditions it was measured in."""
    import os
    import platform
    import torch
    from dlite.envinfo import cpu_model
    before = os.getloadavg()[0]
    speed = _replay_all(cfg_dict, drafters, records, temperatures, threads, timed=True, calibration=calibration)
    return speed, {"loadavg_1m_before": round(before, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "cpu_model": cpu_model(),
                   "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   "host": platform.node()}


def _method_report(cfg, name: str, parts: list, speed: dict, temperatures: list) -> dict:
    from dlite.decoding.replay import aggregate, resolve_args
    from dlite.decoding.ties import lossless_rule
    by_t = {}
    for t in temperatures:
        key, a = str(t), resolve_args(cfg.eval, temperature=t)
        a.buckets = tuple(a.buckets)
        rep = aggregate([r for p in parts for r in p[name][key][0]], sum(p[name][key][1] for p in parts), a)
        fast = aggregate(*speed[name][key], a)
        rep.update({k: fast[k] for k in SPEED_KEYS}, speed_tasks=fast["n_tasks"])
        if rep["lossless"] is not None:  # the speed replay is checked too
            rep["lossless"] = rep["lossless"] and fast["lossless"]
            rep["lossless_up_to_ties"] = rep["lossless_up_to_ties"] and fast["lossless_up_to_ties"]
        by_t[key] = rep
    first = by_t[str(min(temperatures))]
    return {**{k: v for k, v in first.items() if k != "per_task"}, "temperature": min(temperatures),
            "by_temperature": by_t, "lossless": all(r["lossless"] is not False for r in by_t.values()),
            "lossless_up_to_ties": all(r["lossless_up_to_ties"] is not False for r in by_t.values()),
            "lossless_rule": lossless_rule(cfg.target.dtype)}


def evaluate(cfg, drafters: Dict[str, str]) -> dict:
    """Acceptance over workers, then speed on one; the report of every drafter."""
    from dlite import target as tgt
    from dlite.decoding.metrics import hybrid_vs_best, learned_over_free
    from dlite.decoding.ties import lossless_rule
    from dlite.envinfo import env_info
    if not drafters:
        raise ValueError("evaluate: no drafters to evaluate")
    drafters = {n: str(Path(d).resolve()) for n, d in sorted(drafters.items(), key=lambda kv: _rank(kv[0]))}
    ctx = _context_vocab_methods(cfg, drafters)
    clash = set(drafters) & {*ctx, *cfg.eval.baselines, *cfg.eval.hybrids}
    if clash:
        raise ValueError(f"evaluate: drafter name(s) {sorted(clash)} are eval.context_vocab / "
                         f"eval.baselines / eval.hybrids methods too: name the drafter otherwise (NAME=DIR)")
    _check_dtype(cfg, drafters)
    (records, heldout), temps = heldout_set(cfg), sorted({float(t) for t in cfg.eval.temperatures})
    n = min(cfg.eval.num_workers or cfg.cluster.num_workers, len(records))
    init_ray(cfg)
    conf = OmegaConf.to_container(cfg, resolve=True)
    gpus = cfg.cluster.gpus_per_worker if cfg.cluster.use_gpu else 0
    task = ray.remote(num_cpus=1, num_gpus=gpus)(_replay_all)
    extra = [*ctx, *cfg.eval.baselines, *cfg.eval.hybrids]
    if heldout["quarantined"]:
        print(f"[evaluate] held-out {heldout['path']}: {heldout['read']} read, {heldout['used']} used, "
              f"{heldout['quarantined']} quarantined {heldout['reasons']}", flush=True)
    print(f"[evaluate] {len(drafters)} drafters{' + ' + ', '.join(extra) if extra else ''} x "
          f"{len(records)} trajectories x T={temps} on {n} workers, then speed on 1 worker", flush=True)
    calibration = hybrid_calibration(cfg, conf, drafters, gpus)
    parts = ray.get([task.remote(conf, drafters, records[i::n], temps, calibration=calibration) for i in range(n)])
    timer = ray.remote(num_cpus=1, num_gpus=gpus)(_timed_replay)
    speed, timing = ray.get(timer.remote(conf, drafters, records[:cfg.eval.speed_trajectories], temps,
                                         cfg.eval.threads, calibration))
    throughput = None
    if cfg.eval.concurrency:  # alone on one worker, as the speed replay
        from pipelines.stages.evaluate_throughput import stage_throughput
        worker = ray.remote(num_cpus=1, num_gpus=gpus)(stage_throughput)
        throughput = ray.get(worker.remote(conf, drafters, records, cfg.eval.threads, calibration))
    names = [*drafters, *ctx, *cfg.eval.baselines, *cfg.eval.hybrids]  # as `method_builders` orders them
    methods = {name: {**_method_report(cfg, name, parts, speed, temps), "drafter": drafters.get(name)}
               for name in names}
    _add_reliability(cfg, methods, parts, calibration, temps)
    primary = next(iter(methods))
    keep = ("tau", "accept_at_k", "tau_by_bucket", "accept_at_k_by_bucket", "speedup_vs_ar",
            "speedup_vs_ar_by_bucket", "draft_ms_by_bucket", "draft_cache_bytes_by_bucket",
            "time_split", "lossless", "bucket_labels", "gamma", "speedup_vs_ar_lower", "speedup_vs_ar_spread")
    return {"methods": methods, "primary": primary, **{k: methods[primary][k] for k in keep},
            "lossless": all(m["lossless"] for m in methods.values()),
            "lossless_up_to_ties": all(m["lossless_up_to_ties"] for m in methods.values()),
            "lossless_rule": lossless_rule(cfg.target.dtype),
            "plain": {"tokens_per_s": methods[primary]["tokens_per_s"]["plain"]},
            "timing": {**timing, "plain_tokens_per_s": methods[primary]["tokens_per_s"]["plain"],
                       "pairs": methods[primary]["speedup_vs_ar_spread"]["n_pairs"]},
            "n_trajectories": len(records), "heldout": heldout, "target_fingerprint": tgt.fingerprint(cfg.target),
            "calibration": calibration, **({"throughput": throughput} if throughput else {}),
            **({"hybrid_vs_best": hybrid_vs_best(methods)} if cfg.eval.hybrids else {}),
            **({"learned_over_free": over_free} if (over_free := learned_over_free(methods)) else {}),
            "config": conf, "env": env_info()}


def _add_reliability(cfg, methods: dict, parts: list, calibration: Optional[dict], temps: list) -> None:
    """Each tree hybrid's `calibration_reliability` on the reported turns (greedy, the
    acceptance replay's rounds; `dlite.decoding.calibration.reliability`), overall and
    per context bucket: the calibration was fitted on other turns, and a source whose
    acceptance it overstates makes the hybrid verify what then fails."""
    if not calibration or 0.0 not in temps:
        return
    from dlite.decoding.calibration import Calibration, reliability
    from dlite.decoding.metrics import bucket_of
    cal, buckets = Calibration.from_dict(calibration), tuple(cfg.eval.buckets)
    for name in cfg.eval.hybrids:
        rounds = [r for p in parts for res in p[name]["0.0"][0] for r in res["rounds"]]
        rel = reliability(cal, rounds)
        if rel is None:
            continue
        by_bucket: Dict[str, list] = {}
        for r in rounds:
            by_bucket.setdefault(bucket_of(r["context_len"], buckets), []).append(r)
        per = {b: reliability(cal, rs) for b, rs in by_bucket.items()}
        methods[name]["calibration_reliability"] = {"all": rel, **{b: x for b, x in per.items() if x}}


def _context_vocab_methods(cfg, drafters: Dict[str, str]) -> list:
    """[`<primary>_ctxvocab`] when eval.context_vocab, else []. Checked here, before any
    Ray work, from the primary artifact's config.json: the per-request vocabulary
    extends a static draft vocabulary of a history-free (DLite) drafter."""
    if not cfg.eval.context_vocab:
        return []
    from dlite.decoding.methods import context_vocab_name
    name, path = next(iter(drafters.items()))
    conf, arch = _artifact(path)
    if conf.get("draft_vocab_size") is None or arch != "dlite":
        raise ValueError(f"eval.context_vocab: the primary drafter {name} ({path}) must be a DLite drafter "
                         f"with a draft vocabulary (architecture {arch!r}, "
                         f"draft_vocab_size {conf.get('draft_vocab_size')})")
    return [context_vocab_name(name)]


def _check_dtype(cfg, drafters: Dict[str, str]) -> None:
    """A drafter trained on features of the target in one dtype is evaluated against the
    target in that dtype, or not at all (before any Ray work)."""
    for name, path in drafters.items():
        conf, _ = _artifact(path)
        if conf.get("target_dtype", cfg.target.dtype) != cfg.target.dtype:
            raise ValueError(f"target.dtype {cfg.target.dtype!r} but drafter {name} ({path}) was trained "
                             f"on features of the target in {conf['target_dtype']!r}")


def _rank(name: str) -> int:
    return METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER)


def metric_items(report: dict) -> dict:
    """The report as flat MLflow metrics: `<method>.<greedy|t1>.<metric>[.<slot|bucket>]`
    (MLflow names allow no `<` / `>`, so bucket labels become lt1K / gt16K)."""
    out = {}
    for name, m in report["methods"].items():
        for t, r in m["by_temperature"].items():
            pre = f"{name}.{'greedy' if float(t) == 0 else 't' + format(float(t), 'g')}"
            for k in ("tau", "speedup_vs_ar", "speedup_vs_ar_lower", "speedup_vs_ar_e2e", "draft_vocab_coverage",
                      "verified"):
                if r.get(k) is not None:
                    out[f"{pre}.{k}"] = r[k]
            out.update({f"{pre}.accept_at_k.{i + 1}": v for i, v in enumerate(r["accept_at_k"]) if v is not None})
            out.update({f"{pre}.tau_by_bucket.{metric_label(b)}": v for b, v in r["tau_by_bucket"].items() if v is not None})
            # Hybrids: which source the accepted tokens came from; a tree's branches alone.
            out.update({f"{pre}.source_share.{src}": f["share"] for src, f in (r.get("by_source") or {}).items()})
            out.update({f"{pre}.branch_tau_alone.{src}": f["tau_alone"] for src, f in (r.get("branches") or {}).items()})
        out[f"{name}.lossless"] = float(bool(m["lossless"]))
        out[f"{name}.lossless_up_to_ties"] = float(bool(m.get("lossless_up_to_ties", m["lossless"])))
    for h, row in (report.get("hybrid_vs_best") or {}).items():  # over the best single method
        for metric in ("tau", "speedup", "time"):
            out.update({f"{h}.over_best.{metric}.{metric_label(b)}": f["ratio"]
                        for b, f in (row.get(metric) or {}).items() if f["ratio"] is not None})
        rel = (report["methods"].get(h) or {}).get("calibration_reliability") or {}
        out.update({f"{h}.calibration_ratio.{src}": c["all"]["ratio"]
                    for src, c in (rel.get("all") or {}).items() if c["all"]["ratio"] is not None})
        for bound in ("lower_bound", "upper_bound"):  # the decode-time ratio's bootstrap interval
            out.update({f"{h}.over_best.time_{bound}.{metric_label(b)}": f[bound]
                        for b, f in (row.get("time") or {}).items() if f.get(bound) is not None})
    for h, row in (report.get("learned_over_free") or {}).items():  # what the learned drafter adds
        for metric in ("tau", "speedup", "time"):
            out.update({f"{h}.over_free.{metric}.{metric_label(b)}": f["ratio"]
                        for b, f in (row.get(metric) or {}).items() if f["ratio"] is not None})
    if report.get("throughput"):
        from pipelines.stages.evaluate_throughput import metric_items as throughput_items
        out.update(throughput_items(report["throughput"], "throughput."))
    for k in ("loadavg_1m_before", "loadavg_1m_after", "plain_tokens_per_s", "torch_threads"):
        if (report.get("timing") or {}).get(k) is not None:  # the conditions the speed was timed in
            out[f"timing.{k}"] = float(report["timing"][k])
    return out


def metric_label(bucket: str) -> str:
    return bucket.replace("<", "lt").replace(">", "gt")


def evaluate_stage(cfg, drafters: Dict[str, str], output, parent_run_id=None) -> dict:
    """The stage: evaluate, write `<output>/report.json` last (a rerun returns it), plot,
    log metrics + report + plots to the stage's MLflow child run."""
    from pipelines.common import plots, tracking
    out = Path(output).resolve()
    if (out / REPORT).is_file():
        return json.loads((out / REPORT).read_text())
    uri = cfg.tracking.uri
    with tracking.child_run(cfg, "evaluate", out, parent_run_id) as run_id:
        report = evaluate(cfg, drafters)
        stage = out / ".staging"  # the report lands in `out` only after it is logged
        stage.mkdir(exist_ok=True)
        (stage / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        pngs = [plots.accept_at_k_plot(report["methods"], out / "accept_at_k.png"),
                plots.tau_by_bucket_plot(report["methods"], out / "tau_by_bucket.png")]
        if report.get("throughput"):
            from pipelines.stages.evaluate_throughput import plots as throughput_plots
            pngs += throughput_plots(report["throughput"], out / "throughput")
        tracking.log_metrics(uri, run_id, 0, metric_items(report))
        for f in [stage / REPORT, *pngs]:
            tracking.log_artifact(uri, run_id, f, "evaluation")
        (stage / REPORT).rename(out / REPORT)
    return report
