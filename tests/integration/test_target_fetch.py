"""Remote targets (what `jobs.watch_target` submits): an object-store checkpoint and a
registered MLflow model version (on a real `mlflow server`) are copied once under
`run.output_dir/targets/`, with the same content fingerprint as the source; a changed
checkpoint gets a new copy; bad sources fail naming `target.path`; a dry run fetches
nothing."""

import shutil

import pytest
from omegaconf import OmegaConf

from dlite import target
from dlite.config import load_config
from dlite.tiny import TARGET_PATH, TOKENIZER_PATH
from pipelines.common.target_fetch import SOURCE_FILE, TargetFetchError, localize


@pytest.fixture
def checkpoint(tmp_path):
    """The tiny target laid out as a real checkpoint (weights and tokenizer together)."""
    d = tmp_path / "store" / "ckpt-0001"
    shutil.copytree(TARGET_PATH, d)
    for f in TOKENIZER_PATH.iterdir():
        shutil.copy(f, d / f.name)
    return d


def _cfg(tmp_path, path, uri=None):
    over = [f"target.path={path}", f"run.output_dir={tmp_path / 'runs'}"] + ([f"tracking.uri={uri}"] if uri else [])
    return load_config("configs/experiments/tiny.yaml", over)


def _fp(path):
    return target.fingerprint(OmegaConf.create({"path": str(path), "name": "tiny", "revision": None}))["id"]


def test_filesystem_uri_copied_once_and_again_when_changed(tmp_path, checkpoint):
    cfg = localize(_cfg(tmp_path, checkpoint.as_uri()))
    local = cfg.target.path
    assert local.startswith(str(tmp_path / "runs" / "targets")) and _fp(local) == _fp(checkpoint)
    marker = (tmp_path / "runs" / "targets").glob(f"*/{SOURCE_FILE}")
    stamp = next(marker).stat().st_mtime_ns
    assert localize(_cfg(tmp_path, checkpoint.as_uri())).target.path == local  # reused
    assert (next((tmp_path / "runs" / "targets").glob(f"*/{SOURCE_FILE}")).stat().st_mtime_ns == stamp)
    (checkpoint / "generation_config.json").write_text('{"bos_token_id": 1}\n')  # overwritten in place
    again = localize(_cfg(tmp_path, checkpoint.as_uri())).target.path
    assert again != local and (tmp_path / "runs" / "targets").is_dir()
    model, tok = target.load(OmegaConf.create({"path": again, "name": "tiny", "revision": None}))
    assert model.config.num_hidden_layers == 2 and tok.eos_token_id is not None


def test_a_crashed_copy_is_not_trusted(tmp_path, checkpoint):
    cfg = _cfg(tmp_path, checkpoint.as_uri())
    first = localize(cfg).target.path
    shutil.rmtree(first)  # as if the copy never completed: only the partial dir remains
    partial = tmp_path / "runs" / "targets" / (first.rsplit("/", 1)[1] + ".partial")
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{broken")
    assert localize(cfg).target.path == first and _fp(first) == _fp(checkpoint)
    assert not partial.exists()


def test_registered_model_version(tmp_path, checkpoint, mlflow_server):
    from pipelines.common import tracking
    c = tracking.client(mlflow_server)
    exp = c.create_experiment("target-fetch-test")
    run = c.create_run(exp)
    c.log_artifacts(run.info.run_id, str(checkpoint), "model")
    c.create_registered_model("fetch-test-target")
    c.create_model_version("fetch-test-target", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    c.set_registered_model_alias("fetch-test-target", "candidate", "1")
    cfg = localize(_cfg(tmp_path, "models:/fetch-test-target@candidate", mlflow_server))
    assert "fetch-test-target-v1" in cfg.target.path and _fp(cfg.target.path) == _fp(checkpoint)
    assert localize(_cfg(tmp_path, "models:/fetch-test-target/1", mlflow_server)).target.path == cfg.target.path
    with pytest.raises(TargetFetchError, match="target.path: models:/fetch-test-target/7"):
        localize(_cfg(tmp_path, "models:/fetch-test-target/7", mlflow_server))


def test_bad_sources_name_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetFetchError, match="target.path: .* is empty"):
        localize(_cfg(tmp_path, (tmp_path / "empty").as_uri()))
    with pytest.raises(TargetFetchError, match="neither models"):
        localize(_cfg(tmp_path, "models:/a/b/c"))
    assert localize(_cfg(tmp_path, "builtin:tiny")).target.path == "builtin:tiny"  # local: untouched


def test_pipeline_dry_run_fetches_nothing_and_bad_target_exits_2(tmp_path, checkpoint, capsys):
    from jobs import pipeline
    over = [f"run.output_dir={tmp_path / 'runs'}", f"target.path={checkpoint.as_uri()}"]
    assert pipeline.main(["--config", "configs/experiments/tiny.yaml", "--dry-run", *over]) == 0
    assert not (tmp_path / "runs" / "targets").exists()
    (tmp_path / "empty").mkdir()
    bad = [f"run.output_dir={tmp_path / 'runs'}", f"target.path={(tmp_path / 'empty').as_uri()}"]
    assert pipeline.main(["--config", "configs/experiments/tiny.yaml", *bad]) == 2
    assert "target error: target.path:" in capsys.readouterr().err
