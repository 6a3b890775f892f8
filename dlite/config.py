"""The run configuration: one typed schema, YAML files composed onto it, then
`key=value` overrides, then a validation pass. Everything that could make a job fail
late (unknown keys, wrong types, impossible combinations) fails here instead, with a
`ConfigError` that names the dotted key, before any Ray work starts.

Composition order (later wins): schema defaults < `configs/base.yaml` < the files named
in the experiment's `defaults:` list (`{axis: name}` -> `configs/<axis>/<name>.yaml`,
whose body becomes the `<axis>` section) < the experiment's own keys < overrides.
`OmegaConf.to_object(cfg.drafter)` gives a `DrafterConfig` for building models.
"""

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from dlite.config_schema import (BASELINES, HYBRIDS, REGEN_HISTORIES, REGEN_ROWS, STAGES,  # noqa: F401  (re-exported)
                                 DLiteConfig)
from dlite.models.config import prior_root

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
# The embedded tiny target, referred to as `target.path: builtin:tiny`.
TINY_TARGET_DIR = REPO_ROOT / "dlite" / "tiny" / "artifacts" / "target"



class ConfigError(ValueError):
    """A bad configuration; the message always starts with the offending dotted key."""


# ---------------------------------------------------------------- loading

def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> DictConfig:
    """Schema <- base.yaml <- experiment `defaults:` <- experiment <- overrides; validated.
    `path=None` means the schema and base.yaml alone (the tiny default)."""
    cfg = OmegaConf.structured(DLiteConfig)
    exp, root = {}, CONFIG_DIR
    if path is not None:
        exp_path = _find_file(path)
        exp, root = _read_yaml(exp_path), _config_root(exp_path)
    _merge(cfg, _read_yaml(root / "base.yaml"), "base.yaml")
    for item in exp.pop("defaults", None) or []:
        if not (isinstance(item, dict) and len(item) == 1):
            raise ConfigError(f"defaults: entries are {{axis: name}}, got {item!r}")
        (axis, name), = item.items()
        layer = root / str(axis) / f"{name}.yaml"
        if axis not in DLiteConfig.__dataclass_fields__ or not layer.is_file():
            raise ConfigError(f"defaults.{axis}: no config file {layer}")
        _merge(cfg, {axis: _read_yaml(layer)}, f"{axis}/{name}.yaml")
    _merge(cfg, exp, str(path))
    _merge(cfg, _parse_overrides(overrides), "command line")
    try:
        OmegaConf.resolve(cfg)  # interpolations (${oc.env:...}) become plain values
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key}: {_first_line(e)}") from None
    _fill_tracking(cfg)
    validate(cfg)
    return cfg


def _find_file(path: str) -> Path:
    # Relative paths work from the working directory or from the repo root, so jobs
    # run the same under `ray job submit --working-dir .` and from a checkout.
    for p in (Path(path), REPO_ROOT / path):
        if p.is_file():
            return p.resolve()
    raise ConfigError(f"config: no such file {path!r}")


def _config_root(exp_path: Path) -> Path:
    """The configs dir an experiment composes from: two levels up (configs/experiments/
    x.yaml), beside it, or a `configs` dir next to it; else the repo's own."""
    for d in (exp_path.parent.parent, exp_path.parent, exp_path.parent / "configs"):
        if (d / "base.yaml").is_file():
            return d
    return CONFIG_DIR


def _read_yaml(p: Path) -> dict:
    # OmegaConf's loader (not plain PyYAML) so that `1e-4` is a float, not a string.
    try:
        data = OmegaConf.load(p)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"config: cannot read {p}: {e}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"config: {p} must hold a mapping, not a list")
    return OmegaConf.to_container(data)  # interpolations stay strings until resolve


def _parse_overrides(overrides: Iterable[str]) -> dict:
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"{item}: overrides are key=value")
    return OmegaConf.to_container(OmegaConf.from_dotlist(overrides))


def _merge(cfg: DictConfig, data: dict, origin: str) -> None:
    """Merge `data` into `cfg` in place; errors name the dotted key and its source."""
    try:
        cfg.merge_with(data)
    except OmegaConfBaseException as e:
        # omegaconf leaves full_key empty when a scalar replaces a whole section, and
        # sections are the only nested nodes, so the culprit is a top-level key.
        key = e.full_key or next((k for k, v in data.items() if not isinstance(v, dict)),
                                 "config")
        why = "unknown key" if isinstance(e, ConfigKeyError) else _first_line(e)
        raise ConfigError(f"{key}: {why} (from {origin})") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0]


def _fill_tracking(cfg: DictConfig) -> None:
    # Resolved here, not in the tracker, so the logged config shows what was used.
    t = cfg.tracking
    _check_job_paths(cfg)
    t.uri = _absolute_sqlite(t.uri or os.environ.get("MLFLOW_TRACKING_URI") or _default_store(cfg))
    t.experiment = t.experiment or f"dlite-{cfg.target.name}"
    t.registered_model = t.registered_model or f"dlite-{cfg.target.name}"


# Set by Ray's job supervisor for every `ray job submit` / KubeRay RayJob entrypoint.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
RAY_PACKAGE_DIR = "/runtime_resources/working_dir_files/"  # where Ray unpacks --working-dir


def in_ray_job() -> bool:
    """True in the entrypoint of a Ray job: its working directory is Ray's unpacked copy
    of `--working-dir` (garbage-collected with the session; on Kubernetes an ephemeral
    pod disk), so nothing that must outlive the job may be written relative to it."""
    return bool(os.environ.get(RAY_JOB_ENV)) or RAY_PACKAGE_DIR in f"{Path.cwd()}/"


def _default_store(cfg: DictConfig) -> str:
    """The MLflow store when neither tracking.uri nor $MLFLOW_TRACKING_URI names one: by
    hand, `mlflow.db` in the current directory; in a Ray job, beside the stage outputs
    in the (absolute) `run.output_dir`. Not a refusal there: the user already chose that
    directory to outlive the job, and a run's record belongs with its outputs. (SQLite
    on a network volume suits one writer at a time: a multi-node cluster should set
    MLFLOW_TRACKING_URI to a server, as infra/ does.)"""
    if in_ray_job():
        return f"sqlite:///{Path(cfg.run.output_dir) / 'mlflow.db'}"
    return "sqlite:///mlflow.db"


def _relative_store(uri: str) -> bool:
    """A local MLflow store named relative to the current directory."""
    for prefix in ("sqlite:///", "file://", "file:"):
        if uri.startswith(prefix):
            return not uri[len(prefix):].startswith("/")
    return "://" not in uri and uri != "databricks" and not Path(uri).is_absolute()


def _check_job_paths(cfg: DictConfig) -> None:
    """In a Ray job, refuse (before any work) a relative output dir or MLflow store:
    they would resolve inside the job's temporary copy and be lost with it."""
    if not in_ray_job():
        return
    why = f"and this runs as a Ray job whose working dir ({Path.cwd()}) is a temporary copy Ray deletes"
    _require(Path(cfg.run.output_dir).is_absolute(), "run.output_dir",
             f"{cfg.run.output_dir!r} is relative, {why}: the stage outputs and the default "
             "MLflow store would go with it; give an absolute path every node sees "
             "(run.output_dir=/shared/runs)")
    uri, key = cfg.tracking.uri, "tracking.uri"
    if not uri:
        uri, key = os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"
    _require(not (uri and _relative_store(uri)), key,
             f"{uri!r} is relative, {why}: the MLflow record would go with it; use a server "
             "(http://...) or an absolute path every node sees")


def _absolute_sqlite(uri: str) -> str:
    """`sqlite:///mlflow.db` is relative to the current directory, which Ray workers do
    not share with the driver: pin it to the driver's directory."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


# ---------------------------------------------------------------- output

def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_hash(cfg: DictConfig, sections: Optional[Iterable[str]] = None) -> str:
    """sha256 of the resolved YAML, first 12 hex. `sections` hashes only those top-level
    keys, so a stage's output location need not move when unrelated settings change."""
    if sections is not None:
        cfg = OmegaConf.create({k: cfg[k] for k in sections})
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- validation

ENUMS = {
    "drafter.arch": {"dlite", "teacher", "dspark", "dlite_v1"},
    "drafter.context_injection": {"kv", "add", "slots"},
    "drafter.head": {"gru", "attn", "none", "rank"},
    "data.storage_mode": {"full", "anchors"},
    "data.reference": {"last_hidden", "topk"},
    "data.length_policy": {"truncate", "split", "drop"},
    "data.corpus": {"builtin", "agent", "mixed"},
    "train.precision": {"fp32", "bf16"},
    "target.dtype": {"float32", "bfloat16", "float16"},
    "target.attn_implementation": {"sdpa", "sdpa_packed_gqa", "eager", "flash_attention_2"},
    "cluster.backend": {"gloo", "nccl"},
    "eval.turn_pick": {"first", "spread", "context"},
    "eval.lookup.prefer": {"last", "first"},
    "cluster.accelerator": {"cpu", "gpu"},
}
POSITIVE = [
    "drafter.hidden_size", "drafter.num_layers", "drafter.num_heads",
    "drafter.num_kv_heads", "drafter.head_dim", "drafter.intermediate_size",
    "drafter.head_hidden", "drafter.markov_rank", "drafter.sequential_rank", "data.n_train",
    "data.n_heldout",
    "data.max_seq_len", "data.topk", "data.anchors_per_seq", "train.steps_align",
    "train.steps_dspark", "train.lr", "train.batch_size", "train.grad_accum",
    "eval.n_trajectories", "eval.max_new_tokens", "eval.threads", "cluster.num_workers",
    "cluster.cpus_per_worker", "data.regen_max_new_tokens", "data.regen_samples",
    "data.regen_batch_size", "data.records_per_shard",
    "data.batch_tokens", "data.shuffle_buffer", "data.cache_bytes", "eval.speed_trajectories",
    "eval.hybrid_min_match", "eval.lookup.min_ngram", "eval.suffix.max_tree_depth",
    "eval.suffix.max_spec_factor",
]
NULLABLE = {"train.precision", "target.attn_implementation"}  # None: the library's default
NON_NEGATIVE = [
    "data.min_chars", "train.weight_decay", "train.grad_clip", "train.eval_every",
    "train.max_failures", "eval.top_k", "cluster.gpus_per_worker", "gate.min_tau",
    "gate.min_speedup", "gate.tolerance", "data.regen_lookup",
]


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError (naming the key) for the first impossible setting found."""
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    for key, allowed in ENUMS.items():
        _require(get(key) in allowed or (key in NULLABLE and get(key) is None), key,
                 f"{get(key)!r} not one of {sorted(allowed)}")
    for key in POSITIVE:
        _require(get(key) > 0, key, f"must be > 0, got {get(key)}")
    for key in NON_NEGATIVE:
        _require(get(key) >= 0, key, f"must be >= 0, got {get(key)}")
    for stage in cfg.run.stages:
        _require(stage in STAGES, "run.stages", f"{stage!r} not one of {STAGES}")
    _check_drafter(cfg)
    _check_target_layers(cfg)
    _check_draft_vocab(cfg)
    _check_cluster(cfg.cluster)
    _check_data_train_eval(cfg)


def _check_drafter(cfg: DictConfig) -> None:
    d = cfg.drafter
    _require(d.gamma >= 2, "drafter.gamma", f"block size must be >= 2, got {d.gamma}")
    _require(d.num_heads % d.num_kv_heads == 0, "drafter.num_kv_heads",
             f"drafter.num_heads={d.num_heads} is not a multiple of {d.num_kv_heads}")
    _require(cfg.data.max_seq_len > d.gamma, "data.max_seq_len",
             f"must exceed drafter.gamma={d.gamma} to hold one block")


def _check_draft_vocab(cfg: DictConfig) -> None:
    """drafter.draft_vocab_size: null (the full vocabulary), or N ids with gamma <= N <= V
    (fewer than gamma ids could not even hold one block of distinct guesses)."""
    try:
        prior_root(cfg.drafter.draft_vocab_prior)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n, key = cfg.drafter.draft_vocab_size, "drafter.draft_vocab_size"
    if n is None:
        return
    _require(cfg.drafter.head != "rank", key,
             f"{n}, but drafter.head 'rank' drafts over the full vocabulary (its own r -> V "
             f"projection): set null")
    _require(n >= max(2, cfg.drafter.gamma), key,
             f"must be >= drafter.gamma={cfg.drafter.gamma} (or null: the full vocabulary), got {n}")
    vocab = _target_json(cfg.target.path).get("vocab_size")
    _require(vocab is None or n <= vocab, key, f"{n} exceeds the target's vocabulary of {vocab}")


def _target_json(path: str) -> dict:
    """The target's HF config.json when it is on disk (builtin:tiny or a local dir);
    empty for a hub id, whose layer count is only known after downloading."""
    d = TINY_TARGET_DIR if path == "builtin:tiny" else Path(path)
    if path.startswith("pypi:"):  # installed is checked here; converted only when used,
        from dlite.target import gguf  # so its sizes come from target.num_layers/hidden_size
        try:
            gguf.package_gguf(path)
        except gguf.TargetSourceError as e:
            raise ConfigError(str(e)) from None
        return {}
    if not (d / "config.json").is_file():
        return {}
    try:
        return json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ConfigError(f"target.path: {d / 'config.json'} is not valid JSON ({e})") from None


def target_shape(cfg: DictConfig) -> tuple:
    """(num_layers, hidden_size) of the configured target: the config's own values, else
    its config.json (None where neither says)."""
    info = _target_json(cfg.target.path)
    return (cfg.target.num_layers or info.get("num_hidden_layers"),
            cfg.target.hidden_size or info.get("hidden_size"))


def _check_target_layers(cfg: DictConfig) -> None:
    ids, key = list(cfg.drafter.target_layer_ids), "drafter.target_layer_ids"
    _require(len(ids) > 0, key, "must name at least one target layer")
    _require(len(set(ids)) == len(ids), key, f"duplicated ids in {ids}")
    _require(min(ids) >= 0, key, f"ids must be >= 0, got {ids}")
    info = _target_json(cfg.target.path)
    pairs = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"))
    for name, json_key in pairs:
        ours, theirs = cfg.target[name], info.get(json_key)
        _require(ours is None or theirs is None or ours == theirs, f"target.{name}",
                 f"{ours} but {cfg.target.path}/config.json says {theirs}")
    n = cfg.target.num_layers or info.get("num_hidden_layers")
    _require(n is None or max(ids) < n, key, f"{ids} outside the target's {n} layers")
    if cfg.drafter.arch == "dlite_v1":
        _check_dlite_v1(cfg.drafter, n, cfg.target.hidden_size or info.get("hidden_size"))


def _check_dlite_v1(d: DictConfig, n_layers, width) -> None:
    """The published design's fixed choices (`dlite.models.dlite_v1`), where the target's
    depth / width are known here."""
    from dlite.models.dlite_v1 import published_layer_ids
    ids, k = list(d.target_layer_ids), len(d.target_layer_ids)
    _require(d.anchor_group_size in (1, 2), "drafter.anchor_group_size",
             f"must be 1 or 2 for dlite_v1, got {d.anchor_group_size}")
    _require(d.draft_vocab_size is None, "drafter.draft_vocab_size",
             "dlite_v1 drafts over the full vocabulary (its own r -> V projection): set null")
    _require(width is None or d.hidden_size == width, "drafter.hidden_size",
             f"{d.hidden_size}: dlite_v1 runs at the target's width {width}")
    if n_layers is None:  # a hub id: its depth is only known after downloading
        return
    _require(2 <= k <= n_layers, "drafter.target_layer_ids",
             f"{ids}: dlite_v1 needs 2..{n_layers} context layers of the target's {n_layers}")
    want = published_layer_ids(n_layers, k)
    _require(ids == want, "drafter.target_layer_ids",
             f"{ids}: dlite_v1 reads the published selection of {k} of the target's {n_layers} "
             f"layers (first, last, evenly spaced): {want}")


def _check_cluster(c: DictConfig) -> None:
    if c.use_gpu:
        _require(c.accelerator == "gpu", "cluster.use_gpu",
                 "true on cluster.accelerator=cpu")
        _require(c.gpus_per_worker > 0, "cluster.gpus_per_worker", "0 with cluster.use_gpu")
    else:
        _require(c.accelerator == "cpu", "cluster.accelerator",
                 "gpu with cluster.use_gpu=false")
        _require(c.backend != "nccl", "cluster.backend", "nccl needs cluster.use_gpu=true")
        _require(c.gpus_per_worker == 0, "cluster.gpus_per_worker", "> 0 without use_gpu")


def _check_extra_prompts(d) -> None:
    """Prompts are answered by the target (the regenerate stage) and join the built-in
    corpus' input file; the file must exist now, not fail a stage later."""
    _require(d.extra_prompts_limit >= 0, "data.extra_prompts_limit", f"must be >= 0, got {d.extra_prompts_limit}")
    if not d.extra_prompts:
        return
    _require(d.regenerate, "data.extra_prompts", "needs data.regenerate=true (the target writes the answers)")
    _require(not d.train_path, "data.extra_prompts",
             "joins the built-in corpus only; with data.train_path, add the prompts to that input")
    _require(Path(d.extra_prompts).is_file(), "data.extra_prompts", f"no such file: {d.extra_prompts}")


def _check_val_group(d) -> None:
    """A regex with a capture group naming the group (`dlite.train.plan.record_group`),
    refused before any cluster work when it cannot be one."""
    if d.val_group is None:
        return
    try:
        groups = re.compile(d.val_group).groups
    except (re.error, TypeError) as e:
        raise ConfigError(f"data.val_group: not a regular expression: {d.val_group!r} ({e})") from None
    _require(groups >= 1, "data.val_group", f"needs a capture group naming the group, e.g. '^(.+)-\\d+$'; "
             f"got {d.val_group!r}")


def _check_data_train_eval(cfg: DictConfig) -> None:
    d, t, e = cfg.data, cfg.train, cfg.eval
    _require(d.min_chars <= d.max_chars, "data.min_chars",
             f"{d.min_chars} > data.max_chars={d.max_chars}")
    _require(d.regen_temperature >= 0, "data.regen_temperature", f"must be >= 0, got {d.regen_temperature}")
    _require(0 < d.regen_top_p <= 1, "data.regen_top_p", f"not in (0, 1]: {d.regen_top_p}")
    _require(d.regen_history in REGEN_HISTORIES, "data.regen_history",
             f"must be one of {REGEN_HISTORIES}, got {d.regen_history!r}")
    _require(d.regen_rows in REGEN_ROWS, "data.regen_rows", f"must be one of {REGEN_ROWS}, got {d.regen_rows!r}")
    _require(d.regen_samples == 1 or d.regen_temperature > 0, "data.regen_samples",
             f"{d.regen_samples} samples at data.regen_temperature=0 would be identical copies")
    _check_extra_prompts(d)
    _check_val_group(d)
    _require(t.skip_teacher or t.steps_teacher > 0, "train.steps_teacher",
             f"must be > 0 unless train.skip_teacher, got {t.steps_teacher}")
    _require(t.zero_stage is None or 0 <= t.zero_stage <= 3, "train.zero_stage",
             f"not in 0..3: {t.zero_stage}")
    _require(0 <= t.distill_frac <= 1, "train.distill_frac",
             f"not in [0, 1]: {t.distill_frac}")
    _require(0 <= t.warmup_frac < 1, "train.warmup_frac", f"not in [0, 1): {t.warmup_frac}")
    _require(t.supervise in ("assistant", "all"), "train.supervise",
             f"'assistant' or 'all', got {t.supervise!r}")
    _require(t.supervise == "assistant" or d.storage_mode == "full", "train.supervise",
             f"'all' needs data.storage_mode 'full' (anchors storage has features at assistant "
             f"anchors only), got {d.storage_mode!r}")
    _require(all(x >= 0 for x in e.temperatures), "eval.temperatures",
             f"must be >= 0, got {list(e.temperatures)}")
    b = list(e.buckets)
    _require(all(x > 0 for x in b) and b == sorted(set(b)), "eval.buckets",
             f"must be positive and strictly increasing, got {b}")
    _require(0 < e.top_p <= 1, "eval.top_p", f"not in (0, 1]: {e.top_p}")
    _require(e.min_context is None or e.max_context is None or e.min_context <= e.max_context,
             "eval.min_context", f"{e.min_context} > eval.max_context={e.max_context}")
    lo, hi = e.min_chars or d.min_chars, e.max_chars or d.max_chars
    _require(lo <= hi, "eval.min_chars", f"{lo} > eval.max_chars={hi}")
    _require(e.num_workers is None or e.num_workers > 0, "eval.num_workers",
             f"must be > 0 (or null), got {e.num_workers}")
    _check_recipe(cfg)
    _check_eval_methods(e)
    _check_concurrency(e)


def _check_recipe(cfg: DictConfig) -> None:
    """The align stage's recipe keys (`dlite.train.plan`) and the teacher's window."""
    t, w = cfg.train, cfg.drafter.history_window
    _require(t.recipe in ("teacher_init", "published"), "train.recipe",
             f"'teacher_init' or 'published', got {t.recipe!r}")
    _require(0 <= t.blend_frac <= 1 and t.distill_frac + t.blend_frac <= 1, "train.blend_frac",
             f"{t.blend_frac}: must be in [0, 1] with train.distill_frac + blend_frac <= 1")
    _require(t.kl_weight >= 0, "train.kl_weight", f"must be >= 0, got {t.kl_weight}")
    for pre in ("", "teacher_"):  # stage 2's loss and the teacher stage's own
        _check_loss(t, pre)
    _require(t.recipe == "teacher_init" or cfg.drafter.head != "none", "train.recipe",
             "'published' copies and freezes the teacher's sequential head: drafter.head is 'none'")
    _require(w is None or w > 0, "drafter.history_window", f"must be > 0 (or null), got {w}")
    _require(not cfg.drafter.v1_teacher, "drafter.v1_teacher",
             "set by the teacher stage for a dlite_v1 design (drafter.arch=dlite_v1), not in a run config")


def _check_loss(t: DictConfig, pre: str) -> None:
    """One stage's CE + TV loss keys (`train.<pre>ce_weight`, ...)."""
    for key in ("ce_weight", "tv_weight"):
        _require(t[pre + key] >= 0, f"train.{pre}{key}", f"must be >= 0, got {t[pre + key]}")
    _require(t[pre + "ce_weight"] + t[pre + "tv_weight"] > 0, f"train.{pre}ce_weight",
             f"{pre}ce_weight + {pre}tv_weight must be > 0")
    decay = t[pre + "loss_decay"]
    _require(decay is None or decay > 0, f"train.{pre}loss_decay", f"must be > 0 (or null: no decay), got {decay}")
    _require(t[pre + "ce_labels"] in ("data", "target_argmax"), f"train.{pre}ce_labels",
             f"'data' or 'target_argmax', got {t[pre + 'ce_labels']!r}")


def _check_concurrency(e: DictConfig) -> None:
    """eval.concurrency: positive integers; eval.concurrency_requests: null or >= 1."""
    _require(all(isinstance(c, int) and c >= 1 for c in e.concurrency), "eval.concurrency",
             f"must be a list of positive integers, got {list(e.concurrency)}")
    n = e.concurrency_requests
    _require(n is None or n >= 1, "eval.concurrency_requests", f"must be >= 1 (or null), got {n}")


def _check_eval_methods(e: DictConfig) -> None:
    """Training-free baselines, hybrids and the early-stop threshold of learned drafters."""
    for key, names, allowed in (("eval.baselines", e.baselines, BASELINES),
                                ("eval.hybrids", e.hybrids, tuple(HYBRIDS))):
        bad = [n for n in names if n not in allowed]
        _require(not bad and len(set(names)) == len(names), key,
                 f"{list(names)}: each must be one of {list(allowed)}, at most once")
    _require(0 <= e.draft_stop_prob < 1, "eval.draft_stop_prob", f"not in [0, 1): {e.draft_stop_prob}")
    for key in ("lookup_gamma", "hybrid_gamma"):
        _require(e[key] is None or e[key] > 0, f"eval.{key}", f"must be > 0 (or null), got {e[key]}")
    _require(e.lookup.min_ngram <= e.lookup.max_ngram, "eval.lookup.max_ngram",
             f"{e.lookup.max_ngram} < eval.lookup.min_ngram={e.lookup.min_ngram}")
    _require(0 <= e.suffix.min_token_prob <= 1, "eval.suffix.min_token_prob",
             f"not in [0, 1]: {e.suffix.min_token_prob}")
    _check_hybrid_scoring(e)


def _check_hybrid_scoring(e: DictConfig) -> None:
    """The choose / tree hybrids' verify-cost curve, tree budget and calibration set."""
    t, c = list(e.verify_cost_tokens), list(e.verify_cost)
    _require(len(t) == len(c) and len(t) >= 1, "eval.verify_cost",
             f"needs one cost per eval.verify_cost_tokens entry, got {c} for {t}")
    _require(all(x >= 1 for x in t) and t == sorted(set(t)), "eval.verify_cost_tokens",
             f"must be increasing token counts >= 1, got {t}")
    _require(all(x > 0 for x in c) and c == sorted(c), "eval.verify_cost",
             f"must be positive and non-decreasing (more tokens never cost less), got {c}")
    _require(e.tree_budget >= 1, "eval.tree_budget", f"must be >= 1, got {e.tree_budget}")
    k = list(e.cost_contexts)
    _require(all(x >= 1 for x in k) and k == sorted(set(k)), "eval.cost_contexts",
             f"must be increasing context lengths >= 1, got {k}")
    _require(e.calibration_trajectories >= 0, "eval.calibration_trajectories",
             f"must be >= 0, got {e.calibration_trajectories}")
    _require(e.calibration_max_turns is None or e.calibration_max_turns > 0, "eval.calibration_max_turns",
             f"must be > 0 (or null), got {e.calibration_max_turns}")
