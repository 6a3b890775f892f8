"""The tracking store checked once, before a job does any work: a server that is down,
a wrong password or a missing permission ends the job in seconds with one line
(`TrackingError`), not after minutes of retries or an hour of training. A local SQLite
/ file store, and any output directory (`probe_write`), must be writable."""

import os
import re
import tempfile
from pathlib import Path
from typing import Optional


class TrackingError(RuntimeError):
    """The tracking store cannot take this job's record; the message is one line that
    names the URI and what to do."""


# The basic-auth permissions that allow a job's writes (runs, metrics, versions, aliases).
_WRITE = ("EDIT", "MANAGE")
_HELP = "infra/README.md, 'MLflow users and permissions'"
_ANONYMOUS = "a client with no credentials"


def preflight(cfg, registry: bool = False, timeout: float = 5.0) -> None:
    """One check of `tracking.uri` before any work. A server: reachable, these
    credentials accepted, and, where the basic-auth app runs, EDIT (or MANAGE) for
    this user on the experiment and, with `registry`, on the registered model
    (ones that do not exist yet are created by this job, which then owns them).
    A local SQLite / file store: its directory can be written. Raises TrackingError."""
    t, uri = cfg.tracking, cfg.tracking.uri
    if uri.startswith(("http://", "https://")):
        exp = _get(uri, "/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": t.experiment},
                   timeout, f"experiment {t.experiment!r}")
        resources = [("experiment", exp and exp["experiment"]["experiment_id"], t.experiment)]
        if registry:
            rm = _get(uri, "/api/2.0/mlflow/registered-models/get", {"name": t.registered_model},
                      timeout, f"registered model {t.registered_model!r}")
            resources.append(("registered_model", rm and t.registered_model, t.registered_model))
        _check_permissions(uri, [r for r in resources if r[1]], timeout)
        return
    local = _local_store_dir(uri)
    if local is not None:
        try:
            probe_write(local)
        except OSError as e:
            raise TrackingError(f"MLflow store {uri}: cannot write {local} ({_oserror(e)}): "
                                f"make it writable, or set MLFLOW_TRACKING_URI / tracking.uri "
                                f"to another store") from None


def _who() -> str:
    from mlflow.utils.credentials import read_mlflow_creds
    user = read_mlflow_creds().username
    if user:
        return f"user {user!r}"
    return "a token (MLFLOW_TRACKING_TOKEN)" if os.environ.get("MLFLOW_TRACKING_TOKEN") else _ANONYMOUS


def _request(uri: str, endpoint: str, params: dict, timeout: float):
    """One GET with this process's MLflow credentials (env vars or ~/.mlflow/credentials,
    as every MLflow client reads them), no retries: a down server fails in `timeout`."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request
    try:
        return http_request(get_default_host_creds(uri), endpoint, "GET", max_retries=0,
                            timeout=timeout, raise_on_status=False, params=params)
    except Exception as e:  # noqa: BLE001 -- MLflow wraps every transport error alike
        raise TrackingError(f"MLflow tracking server {uri} is not reachable ({_reason(e)}): start "
                            f"it, or set MLFLOW_TRACKING_URI / tracking.uri to one that "
                            f"runs") from None


def _get(uri: str, endpoint: str, params: dict, timeout: float, what: str) -> Optional[dict]:
    """The JSON answer, None for a resource that does not exist yet; TrackingError for
    a refusal (401: who we are, 403: what we may not read) or any other failure."""
    r = _request(uri, endpoint, params, timeout)
    if r.status_code == 200:
        try:
            return r.json()
        except ValueError:  # e.g. a proxy's login page: not the MLflow API
            raise TrackingError(f"{uri} answered {endpoint} with something other than MLflow's "
                                f"JSON: is tracking.uri / MLFLOW_TRACKING_URI an MLflow server?") from None
    if r.status_code == 404 and "RESOURCE_DOES_NOT_EXIST" in r.text:
        return None
    who = _who()
    if r.status_code == 401:
        fix = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
               if who == _ANONYMOUS else "check MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN")
        raise TrackingError(f"MLflow tracking server {uri} refused {who} (401 Unauthorized): {fix}")
    if r.status_code == 403:
        raise TrackingError(f"MLflow tracking server {uri}: {who} may not read {what} (403 Forbidden): "
                            f"ask an MLflow admin for EDIT on it ({_HELP})")
    raise TrackingError(f"MLflow tracking server {uri} answered {r.status_code} to {endpoint}: "
                        f"{' '.join(r.text.split())[:200]}")


def _check_permissions(uri: str, resources: list, timeout: float) -> None:
    """EDIT or MANAGE on each existing (type, id, name) for the basic-auth user. Not asked:
    token logins (no user name), servers without the auth app (no users endpoint) and
    admins (who may write anything, whatever the per-resource answer says)."""
    from mlflow.utils.credentials import read_mlflow_creds
    user = read_mlflow_creds().username
    if not user or not resources:
        return
    me = _json(_request(uri, "/api/2.0/mlflow/users/get", {"username": user}, timeout), uri)
    if me is None or me.get("user", {}).get("is_admin"):
        return
    for kind, resource_id, name in resources:
        r = _request(uri, "/api/3.0/mlflow/users/permissions/get",
                     {"username": user, "resource_type": kind, "resource_id": resource_id}, timeout)
        answer = _json(r, uri)
        have = answer.get("permission") if answer is not None else f"HTTP {r.status_code}"
        if have not in _WRITE:
            raise TrackingError(f"MLflow tracking server {uri}: user {user!r} has {have} on "
                                f"{kind.replace('_', ' ')} {name!r}; this job needs EDIT (403 on "
                                f"its first write): ask an MLflow admin to grant it ({_HELP})")


def _json(r, uri: str) -> Optional[dict]:
    """A 200 answer's JSON (None for any other status); one line, not a traceback, when
    a 200 is not JSON (a proxy's login page)."""
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        raise TrackingError(f"{uri} answered with something other than MLflow's JSON: is "
                            f"tracking.uri / MLFLOW_TRACKING_URI an MLflow server?") from None


def _reason(e: Exception) -> str:
    """'Connection refused', 'timed out', ... out of requests' long exception text."""
    text = str(e)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    return "timed out" if "timed out" in text.lower() else " ".join(text.split())[:160]


def _oserror(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _local_store_dir(uri: str) -> Optional[Path]:
    """The directory a local store writes (None: a database server or another scheme)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    return Path(uri) if "://" not in uri and uri != "databricks" else None


def probe_write(directory) -> None:
    """Create a file in `directory` (made if missing) and delete it: the real test of
    write access (permission bits lie for root, read-only mounts and NFS squashing).
    Raises OSError."""
    d = Path(directory)
    if d.exists() and not d.is_dir():  # mkdir would say "File exists": say what is wrong
        raise NotADirectoryError(20, "not a directory", str(d))
    d.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".dlite-write-check-", dir=d)
    os.close(fd)
    os.unlink(name)
