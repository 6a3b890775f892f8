"""infra/ agrees with itself and with the repository: every manifest parses and names
the one image (tagged with the project's version), entry points and config files
exist, the RayCluster's GPUs are the cluster config's workers, Service names and
ports line up, Secrets and volumes are the ones the README creates, and the
Dockerfile pins versions inside pyproject.toml's ranges."""

import importlib
import os
import re
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from dlite.config import load_config

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
DOCKERFILE = (INFRA / "Dockerfile").read_text()
README = (INFRA / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _docs():
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            assert doc["apiVersion"] and doc["metadata"]["name"], f
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


DOCS = _docs()


def _one(kind):
    (doc,) = [d for (k, _), d in DOCS.items() if k == kind]
    return doc


def _walk(node, key):
    """Every value stored under `key`, anywhere below `node`."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)


def _containers(doc):
    return [c for cs in _walk(doc, "containers") for c in cs]


def _pod_specs(doc):
    """The pod specs of a manifest (the dicts that hold `containers`)."""
    found = []

    def visit(n):
        if isinstance(n, dict):
            if "containers" in n:
                found.append(n)
            for v in n.values():
                visit(v)
        elif isinstance(n, list):
            for v in n:
                visit(v)
    visit(doc)
    return found


def _pins():
    """{package: version} of every `name==version` (extras allowed) in the Dockerfile."""
    pin = re.compile(r'([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([0-9][^"\s\\]*)')
    return {m[1].lower(): m[2] for m in pin.finditer(DOCKERFILE)}


@pytest.fixture
def clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("DLITE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.invalid:5000")


# ---------------------------------------------------------------- one image

def test_every_manifest_runs_the_one_image_tagged_with_the_project_version():
    images = {c["image"] for doc in DOCS.values() for c in _containers(doc)}
    assert len(images) == 1, images
    (image,) = images
    assert image.rsplit(":", 1)[1] == PYPROJECT["version"]
    # The README's build command and the Dockerfile's own example name the same tag.
    assert image in README and image in DOCKERFILE
    kinds = {k for (k, _), d in DOCS.items() if _containers(d)}
    assert {"RayCluster", "CronJob", "Deployment"} <= kinds


def test_dockerfile_pins_satisfy_pyproject():
    pins = _pins()
    for dep in PYPROJECT["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower()
        assert name in pins, f"infra/Dockerfile does not pin {name}"
        assert req.specifier.contains(Version(pins[name])), \
            f"{name}=={pins[name]} in infra/Dockerfile is outside pyproject's {req.specifier}"
    for name in ("torch", "ray", "deepspeed", "mlflow", "transformers"):
        assert name in pins


def test_dockerfile_shape():
    assert re.search(r"^FROM nvidia/cuda:\S+-cudnn-runtime-ubuntu\S+", DOCKERFILE, re.M)
    assert "python3.11" in DOCKERFILE and PYPROJECT["requires-python"] == ">=3.11"
    assert re.search(r"^RUN pip install \.", DOCKERFILE, re.M)
    assert re.search(r"^WORKDIR /app", DOCKERFILE, re.M)
    users = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert users and users[-1] not in ("root", "0")
    pods = [p for d in DOCS.values() for p in _pod_specs(d)]
    assert all(p.get("securityContext", {}).get("runAsNonRoot") for p in pods)


def test_ray_version_matches_the_image():
    assert _one("RayCluster")["spec"]["rayVersion"] == _pins()["ray"]


# ---------------------------------------------------------------- entry points, configs

def _commands():
    """(manifest, argv) of every command a manifest runs."""
    out = [("RayJob", shlex.split(_one("RayJob")["spec"]["entrypoint"]))]
    for (kind, _), doc in DOCS.items():
        for c in _containers(doc):
            if c.get("command"):
                out.append((kind, [*c["command"], *c.get("args", [])]))
    return out


def _module_args(argv):
    if argv[:2] != ["python", "-m"]:
        return None, {}
    flags, i = {}, 3
    while i < len(argv):
        if argv[i].startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[argv[i]] = argv[i + 1]
            i += 2
        else:
            flags[argv[i]] = True
            i += 1
    return argv[2], flags


@pytest.mark.parametrize("kind,argv", _commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_entrypoint_module_flags_and_config(kind, argv, clean_env, capsys):
    module, flags = _module_args(argv)
    if module is None:
        assert argv[0] == "mlflow", argv
        return
    assert module.startswith("jobs."), argv
    path = ROOT / (module.replace(".", "/") + ".py")
    if module == "jobs.watch_target" and not path.exists():
        pytest.skip("jobs/watch_target.py has not landed yet; this check goes live with it")
    assert path.is_file(), f"{kind} runs {module}, but there is no {path.relative_to(ROOT)}"
    assert "--config" in flags and (ROOT / flags["--config"]).is_file(), argv
    # The job's own parser accepts every flag and validates the config; --print-config
    # stops it right there (exit 0) before it does any work.
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main([*argv[3:], "--print-config"])
    assert stop.value.code == 0, capsys.readouterr().err


def test_rayjob_runs_the_8b_pipeline_on_the_raycluster():
    spec, cluster = _one("RayJob")["spec"], _one("RayCluster")
    assert spec["entrypoint"] == \
        "python -m jobs.pipeline --config configs/experiments/qwen3_8b_swe.yaml"
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert spec["shutdownAfterJobFinishes"] is False  # never delete a cluster it did not make
    assert spec["submissionMode"] in ("HTTPMode", "K8sJobMode")


def test_rayjob_env_vars_are_the_ones_the_config_reads():
    env = yaml.safe_load(_one("RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    cfg_text = "".join(p.read_text() for p in (
        ROOT / "configs/experiments/qwen3_8b_swe.yaml", ROOT / "configs/target/qwen3_8b.yaml"))
    read = set(re.findall(r"oc\.env:([A-Z_]+)", cfg_text))
    assert env and set(env) <= read, set(env) - read


# ---------------------------------------------------------------- cluster shape

def _gpus(container):
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_raycluster_gpus_match_the_cluster_config(clean_env):
    c = load_config("configs/experiments/qwen3_8b_swe.yaml").cluster
    spec = _one("RayCluster")["spec"]
    (head,) = _containers(spec["headGroupSpec"])
    assert _gpus(head) == 0
    total = 0
    for g in spec["workerGroupSpecs"]:
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"], g["groupName"]
        (w,) = _containers(g)
        assert _gpus(w) == 8, "H800 nodes carry 8 GPUs"
        # every Ray Train worker on a node gets its CPUs
        workers_per_pod = _gpus(w) // c.gpus_per_worker
        assert int(w["resources"]["limits"]["cpu"]) >= workers_per_pod * c.cpus_per_worker
        total += g["replicas"] * _gpus(w)
    assert total == c.num_workers * c.gpus_per_worker == 16
    assert c.backend == "nccl"


def _head_port(name):
    (head,) = _containers(_one("RayCluster")["spec"]["headGroupSpec"])
    return {p["name"]: p["containerPort"] for p in head["ports"]}[name]


def test_watcher_talks_to_the_head_service():
    (cmd,) = [argv for kind, argv in _commands() if kind == "CronJob"]
    _, flags = _module_args(cmd)
    assert flags.get("--once") is True
    addr = urlparse(flags["--address"])
    assert addr.hostname == _one("RayCluster")["metadata"]["name"] + "-head-svc"
    assert addr.port == _head_port("dashboard") == 8265
    assert _one("CronJob")["spec"]["concurrencyPolicy"] == "Forbid"


def test_jobs_report_to_the_mlflow_service():
    uri = urlparse(_one("ConfigMap")["data"]["MLFLOW_TRACKING_URI"])
    svc = _one("Service")
    assert uri.hostname == svc["metadata"]["name"]
    assert uri.port == svc["spec"]["ports"][0]["port"]
    (server,) = _containers(_one("Deployment"))
    argv = [*server["command"], *server["args"]]
    assert argv[:2] == ["mlflow", "server"]
    opts = dict(a.split("=", 1) if "=" in a else (a, True) for a in argv[2:])
    assert opts["--serve-artifacts"] is True
    assert opts["--artifacts-destination"].startswith("s3://")
    # The Host header jobs send ("mlflow:5000") must be allowed.
    assert f"{uri.hostname}:{uri.port}" in opts["--allowed-hosts"].split(",")
    # The PostgreSQL URI comes from a Secret, never from the manifest.
    var = re.fullmatch(r"\$\((\w+)\)", opts["--backend-store-uri"])[1]
    (src,) = [e["valueFrom"]["secretKeyRef"] for e in server["env"] if e["name"] == var]
    assert src["name"] in _readme_secrets()


def test_token_auth_on_the_cluster_and_its_clients():
    """The RayCluster has Ray's token auth on with a Secret the README creates; the
    watcher, a client of its job API, presents that token the way Ray reads it."""
    auth = _one("RayCluster")["spec"]["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"] in _readme_secrets()
    (watcher,) = _containers(_one("CronJob"))
    env = {e["name"]: e for e in watcher["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": auth["secretName"],
                                                                 "key": "auth_token"}
    assert "RAY_AUTH_MODE=token" in README and "RAY_AUTH_TOKEN=" in README


# ---------------------------------------------------------------- what must exist first

def _readme_secrets():
    return set(re.findall(r"kubectl create secret generic ([\w-]+)", README))


def test_referenced_secrets_configmaps_and_volumes_are_provided():
    configmaps = {n for (k, n) in DOCS if k == "ConfigMap"}
    for doc in DOCS.values():
        for ref in _walk(doc, "configMapRef"):
            assert ref["name"] in configmaps, ref
        for ref in [*_walk(doc, "secretRef"), *_walk(doc, "secretKeyRef")]:
            assert ref["name"] in _readme_secrets(), f"{ref['name']}: not created in infra/README.md"
        for claim in _walk(doc, "persistentVolumeClaim"):
            assert f"`{claim['claimName']}`" in README, claim
        for vol in _walk(doc, "secret"):
            assert vol["secretName"] in _readme_secrets(), f"{vol['secretName']}: not created in infra/README.md"


def _shared_mounts(doc):
    """mountPath of every container's mount of the dlite-shared claim."""
    out = []
    for pod in _pod_specs(doc):
        vols = {v["name"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        out += [m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])
                if m["name"] in vols]
    return out


def test_config_paths_live_on_the_volume_every_pod_mounts(clean_env):
    mounts = set(_shared_mounts(_one("RayCluster"))) | set(_shared_mounts(_one("CronJob")))
    assert len(mounts) == 1, mounts  # the same path everywhere: paths are passed between pods
    (mount,) = mounts
    for name in ("qwen3_4b_swe", "qwen3_8b_swe"):
        cfg = load_config(f"configs/experiments/{name}.yaml")
        for path in (cfg.target.path, cfg.data.heldout_path, cfg.run.output_dir):
            assert path.startswith(mount + "/"), (name, path)
    (cmd,) = [argv for kind, argv in _commands() if kind == "CronJob"]
    assert _module_args(cmd)[1]["--source"].startswith(mount + "/")


# ---------------------------------------------------------------- MLflow authentication

AUTH_INI = INFRA / "mlflow" / "basic_auth.ini"
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY\b|CREDENTIAL")


def _env(container):
    return {e["name"]: e for e in container.get("env", [])}


def _from_secret(entry):
    return entry.get("valueFrom", {}).get("secretKeyRef")


def test_no_secret_value_in_any_manifest():
    """Passwords, tokens and keys reach pods only from Secrets (created by hand in the
    README), never as literal values in a manifest, a RayJob's runtime env or the
    auth config template."""
    for (kind, name), doc in DOCS.items():
        for c in _containers(doc):
            for var, e in _env(c).items():
                if SECRET_NAME.search(var) and var != "RAY_AUTH_MODE":
                    assert "value" not in e and _from_secret(e), f"{kind}/{name}: {var} is not from a Secret"
    for value in _strings(list(DOCS.values())):  # the manifests' values, not their comments
        assert not re.search(r"://[^\s/:@]+:[^\s/@]+@", value), f"credentials in a URI: {value}"
    runtime_env = yaml.safe_load(_one("RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    assert not [k for k in runtime_env if k.startswith("MLFLOW_TRACKING_") or SECRET_NAME.search(k)]
    ini = AUTH_INI.read_text()
    assert not re.search(r"^\s*admin_password\s*=", ini, re.M)
    assert "DB_PASSWORD" in ini and "sed 's#DB_PASSWORD#" in README  # a placeholder, filled in the Secret


def test_the_mlflow_server_runs_the_basic_auth_app_configured_from_a_secret():
    import configparser
    deploy = _one("Deployment")
    (server,) = _containers(deploy)
    assert "--app-name=basic-auth" in server["args"]
    env = _env(server)
    for var in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert _from_secret(env[var])["name"] in _readme_secrets(), var
    # The auth config is a file of a Secret, mounted where MLFLOW_AUTH_CONFIG_PATH says.
    path = Path(env["MLFLOW_AUTH_CONFIG_PATH"]["value"])
    (mount,) = [m for m in server["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (vol,) = [v for v in _pod_specs(deploy)[0]["volumes"] if v["name"] == mount["name"]]
    assert [i["path"] for i in vol["secret"]["items"]] == [path.name]
    assert f"--from-file={path.name}=" in README
    cfg = configparser.ConfigParser()
    cfg.read_string(AUTH_INI.read_text())
    # Users and grants on the same PostgreSQL server as the runs (the README says why
    # READ is the default: a reviewer needs only an account).
    assert cfg["mlflow"]["default_permission"] in ("READ", "NO_PERMISSIONS")
    assert cfg["mlflow"]["default_permission"] in README
    assert cfg["mlflow"]["database_uri"].startswith("postgresql://")
    runs_db = re.search(r"generic mlflow-db\s*\\\s*--from-literal=uri=(\S+)", README)[1]
    assert urlparse(cfg["mlflow"]["database_uri"]).hostname == urlparse(runs_db).hostname
    assert "mlflow[auth]==" in DOCKERFILE  # the image can run the auth app


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def test_pipeline_clients_log_in_as_the_service_user():
    """Every pod that runs a job talking to MLflow -- the Ray head (job drivers), the
    GPU workers (Ray Train's rank 0 logs losses) and the watcher -- takes
    MLFLOW_TRACKING_USERNAME / _PASSWORD from one Secret, keys `username` / `password`."""
    pods = [*_containers(_one("RayCluster")), *_containers(_one("CronJob"))]
    secrets = set()
    for c in pods:
        env = _env(c)
        for var, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
            ref = _from_secret(env[var])
            assert ref and ref["key"] == key, (c["name"], var)
            secrets.add(ref["name"])
    assert len(secrets) == 1 and secrets <= _readme_secrets(), secrets
    assert "MLFLOW_TRACKING_USERNAME" in README and "grant_user_permission" in README
