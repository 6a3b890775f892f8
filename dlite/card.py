"""The model card's content for a published drafter (`README.md` in the artifact,
ARCHITECTURE.md §3): what it drafts for, how it was trained, the evaluation table
against every other method in the evaluation report, and how to load it.

Also the one reading of an evaluation report that publishing and plotting share:
`report_methods` accepts the pipeline's multi-method report (`{"methods": {name: R},
"primary": ...}`) or a single drafter's report (`jobs.evaluate`), where each R is what
`dlite.decoding.replay` aggregates: greedy metrics at top level, each temperature under
`by_temperature`. Pure python: no MLflow here, so the card is testable on its own.
"""

import math
from typing import Dict, List, Optional, Tuple

from dlite.config_schema import TRAIN_STAGES  # noqa: F401 (publish reads it from here)


def report_methods(report: dict) -> Dict[str, dict]:
    """{method: its metrics}; a single-drafter report counts as method `dlite`."""
    if not isinstance(report, dict):
        raise ValueError(f"report: expected a JSON object, got {type(report).__name__}")
    methods = report.get("methods", {"dlite": report})
    if not isinstance(methods, dict) or not methods:
        raise ValueError("report.methods: no methods to publish or plot (expected {name: metrics})")
    for name, r in methods.items():
        if not isinstance(r, dict) or "tau" not in r:
            raise ValueError(f"report.methods.{name}: not an evaluation result (no `tau`)")
    return methods


def primary_method(report: dict, method: Optional[str] = None) -> str:
    """The method a publish is about: `method`, else the report's `primary`, else the only one."""
    methods = report_methods(report)
    name = method or report.get("primary") or ("dlite" if "dlite" in methods else next(iter(methods)))
    if name not in methods:
        raise ValueError(f"method {name!r} not in the report (has {sorted(methods)})")
    return name


def by_temperature(r: dict) -> List[Tuple[float, dict]]:
    """[(temperature, metrics)] sorted, greedy first; the top level when there is no split."""
    split = r.get("by_temperature") or {str(float(r.get("temperature", 0.0))): r}
    return sorted(((float(t), m) for t, m in split.items()), key=lambda x: x[0])


def finite(x) -> Optional[float]:
    """A float for a real number, None for None / NaN / inf / anything else."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _num(x, fmt: str = "{:.2f}") -> str:
    v = finite(x)
    return "–" if v is None else fmt.format(v)


def fingerprint_id(fp) -> Optional[str]:
    """The id of a target fingerprint: reports carry the whole dict, artifacts the id."""
    return fp.get("id") if isinstance(fp, dict) else fp


# ---------------------------------------------------------------- sections

def intended_use(drafter: dict, report: dict) -> str:
    cfg = report.get("config") or {}
    path = (cfg.get("data") or {}).get("train_path")
    data = f"`{path}`" if path else "the built-in agent-trajectory corpus"
    return (f"A `{drafter.get('architecture')}` speculative-decoding drafter for the target "
            f"`{drafter.get('target_name', 'unknown')}` (fingerprint `{drafter.get('target_fingerprint')}`), "
            f"trained on agent trajectories from {data}. Each round it proposes "
            f"{drafter.get('gamma')} tokens from the target's hidden states (layers "
            f"{drafter.get('target_layer_ids')}); the target verifies them, so what is generated "
            f"is the target's own output, only faster. Use it only with that exact target: "
            f"weights, tokenizer and chat template are all part of the fingerprint.")


def _stage_chain(drafter: dict, train: dict) -> List[str]:
    stage, arch = drafter.get("stage"), drafter.get("architecture")
    teacher = f"`teacher`: the history-aware teacher against the target, {train.get('steps_teacher')} steps"
    if stage == "dspark" or arch == "dspark":
        return [f"`dspark`: the DSpark-style baseline against the target, {train.get('steps_dspark')} steps"]
    if stage == "teacher" or arch == "teacher":
        return [teacher]
    steps = train.get("steps_align")
    if drafter.get("skip_teacher"):
        return [f"`align` (no-teacher ablation): from scratch against the target, {steps} steps"]
    distill = round((train.get("distill_frac") or 0) * (steps or 0))
    return [teacher, (f"`align`: initialised from the teacher, distilling it for {distill} steps, "
                      f"then against the target ({steps} steps in all)")]


def training(drafter: dict, report: dict) -> str:
    cfg = report.get("config") or {}
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    lines = [f"{i}. {s}" for i, s in enumerate(_stage_chain(drafter, train), 1)]
    seed = (cfg.get("run") or {}).get("seed")
    lines += ["",
              (f"- this artifact: stage `{drafter.get('stage')}`, checkpoint at step {drafter.get('step')} "
               f"(best validation tau {_num(drafter.get('val_tau'))}, "
               f"loss {_num(drafter.get('val_loss'), '{:.4f}')})"),
              (f"- data fingerprint (collection plan): `{drafter.get('data_plan_id')}`; "
               f"{data.get('n_train')} training trajectories, max {data.get('max_seq_len')} tokens, "
               f"{data.get('anchors_per_seq')} anchors per sequence, reference `{data.get('reference')}`, "
               f"supervised positions `{train.get('supervise', 'assistant')}`"),
              (f"- optimiser: lr {train.get('lr')}, batch {train.get('batch_size')} x grad_accum "
               f"{train.get('grad_accum')}, warmup {train.get('warmup_frac')}, weight decay "
               f"{train.get('weight_decay')}, seed {seed}")]
    return "\n".join(lines)


def lossless_label(m: dict, rule: Optional[str] = None) -> str:
    """How a report row states losslessness to a reader, under its `lossless_rule` (the
    row's own, else `rule`): "yes" (token for token); "up to ties" (it parted from plain
    decoding only where the target's own top two logits tie -- shape-dependent rounding,
    accepted for a low-precision target); "no (at ties only)" for the same under the
    `exact` rule of an fp32 target, which the release gate refuses; "no"; or "n/a"."""
    strict, up_to_ties = m.get("lossless"), m.get("lossless_up_to_ties")
    if strict is None:
        return "n/a"
    if strict:
        return "yes"
    if not up_to_ties:
        return "no"
    return "no (at ties only)" if (m.get("lossless_rule") or rule) == "exact" else "up to ties"


def _row(name: str, t: float, m: dict, labels: List[str], mark: bool, rule: Optional[str]) -> str:
    acc = " ".join(_num(a) for a in m.get("accept_at_k") or []) or "–"
    tb = m.get("tau_by_bucket") or {}
    buckets = ", ".join(f"{b} {_num(tb[b])}" for b in labels if b in tb) or "–"
    verdict = lossless_label(m, rule)
    lossless = f"**{verdict}**" if verdict.startswith("no") else verdict
    label = f"**{name}** (this)" if mark else name
    return (f"| {label} | {'greedy' if t == 0 else f'T={t:g}'} | {_num(m.get('tau'))} | "
            f"{_num(m.get('speedup_vs_ar'), '{:.2f}x')} | {acc} | {buckets} | {lossless} | "
            f"{m.get('n_tasks', '–')} |")


def evaluation(report: dict, method: str) -> str:
    methods = report_methods(report)
    order = [method] + sorted(n for n in methods if n != method)
    rows = []
    for name in order:
        r = methods[name]
        labels = list(r.get("bucket_labels") or sorted(r.get("tau_by_bucket") or {}))
        rule = r.get("lossless_rule") or report.get("lossless_rule")  # per-temperature rows lack it
        rows += [_row(name, t, m, labels, name == method, rule) for t, m in by_temperature(r)]
    n = (report.get("config") or {}).get("eval", {}).get("n_trajectories")
    head = (f"Speculative decoding against the real target on {n if n is not None else 'the'} held-out "
            "trajectories, every method on the same prompts. tau = tokens per target forward "
            "(accepted + 1); accept@k = share of rounds accepting slot k; speedup = speculative "
            "over plain decoding tokens/s, timed interleaved on the same worker.\n\n"
            "| method | decoding | tau | speedup_vs_ar | accept@1..k | tau by context length "
            "| lossless | tasks |\n"
            "|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def speed_conditions(report: dict, method: str) -> str:
    """Where and how the speedup was measured, and the figure the release gate reads: a
    block verification saves more on a machine whose plain decoding is slower, and load
    moves it too, so the number is only meaningful with its spread and its machine."""
    m, t = report_methods(report)[method], report.get("timing") or {}
    sp = m.get("speedup_vs_ar_spread") or {}
    if not sp.get("n_pairs"):
        return "Speed: no timed pairs in this report."
    where = (f"{t.get('cpu_model', 'an unrecorded machine')} ({t.get('device', 'cpu')}, {t.get('cpu_count', '?')} cores, "
             f"{t.get('torch_threads', '?')} torch threads, 1-min load {t.get('loadavg_1m_before', '?')} -> "
             f"{t.get('loadavg_1m_after', '?')})") if t else "an unrecorded machine"
    return (f"Speed measured on {where}; plain decoding {_num(t.get('plain_tokens_per_s'), '{:.1f}')} tokens/s. "
            f"Speedup {_num(m.get('speedup_vs_ar'), '{:.2f}x')} over {sp['n_pairs']} interleaved plain/speculative "
            f"pairs (per pair {_num(sp.get('min'), '{:.2f}')}-{_num(sp.get('max'), '{:.2f}x')}); lower bound "
            f"**{_num(sp.get('lower_bound'), '{:.2f}x')}** ({sp.get('lower_bound_method')}), which the release gate "
            "decides on. Other machines will differ: rerun the evaluation where the drafter will serve.")


def how_to_load(report: dict, registered_model: Optional[str]) -> str:
    target = (report.get("config") or {}).get("target") or {}
    spec = {"name": target.get("name", "<name>"), "path": target.get("path", "<target dir or hub id>")}
    reg = ""
    if registered_model:
        reg = (f"\n\nFrom the MLflow registry (`MLFLOW_TRACKING_URI` set): "
               f"`mlflow.artifacts.download_artifacts(\"models:/{registered_model}@production\")` "
               f"gives this directory (`@candidate` for the newest).")
    return ("```python\nfrom omegaconf import OmegaConf\nfrom dlite import target as tgt\n"
            "from dlite.export import load_drafter\n\n"
            f"model, tok = tgt.load(OmegaConf.create({spec!r}))  # the target it was trained for\n"
            "embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight\n"
            "drafter = load_drafter(\"path/to/this/dir\", embed, lm_head)\n```\n"
            "Weights are safetensors only; nothing here needs `trust_remote_code`." + reg)


def card_sections(report: dict, drafter: dict, method: Optional[str] = None,
                  registered_model: Optional[str] = None) -> Dict[str, str]:
    """Title -> markdown for `dlite.export.model_card`; `drafter` is the artifact's config.json."""
    method = primary_method(report, method)
    return {"What it drafts for": intended_use(drafter, report),
            "How it was trained": training(drafter, report),
            "Evaluation": evaluation(report, method) + "\n\n" + speed_conditions(report, method),
            "How to load": how_to_load(report, registered_model)}

