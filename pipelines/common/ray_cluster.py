"""Joining or starting Ray: one place, so every stage connects the same way -- and the
console stays readable: Ray's own log lines (Ray Data's progress reports every few
seconds, Train's and Core's INFO lines) go to `<run.output_dir>/logs/ray.log`, named
once on the console, while each stage prints its own one line per unit of work."""
import logging
import os
from pathlib import Path

import ray

RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")
_log_file = None  # the file handler in use (one per process)


def init_ray(cfg) -> None:
    """Join `cluster.address`, else $RAY_ADDRESS (set by `ray job submit`), else start
    Ray locally in this process -- never an unrelated `ray start` cluster found on the
    machine. A no-op when Ray is already up (the log file is still set)."""
    if not ray.is_initialized():
        address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    ray_logs_to_file(Path(cfg.run.output_dir) / "logs" / "ray.log")


def ray_logs_to_file(path: Path) -> Path:
    """Ray Data's progress off, and Ray's loggers written to `path` instead of the
    console (their other handlers, e.g. Ray Data's own ray-data.log, stay)."""
    global _log_file
    from ray.data import DataContext
    DataContext.get_current().enable_progress_bars = False
    path = Path(path).resolve()
    if _log_file is not None and Path(_log_file.baseFilename) == path:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in RAY_LOGGERS:
        log = logging.getLogger(name)
        for h in list(log.handlers):
            if h is _log_file or (isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)):
                log.removeHandler(h)
        log.addHandler(handler)
        log.propagate = False  # nothing reaches the root logger's console handler
    _log_file = handler
    print(f"[ray] Ray's own logs: {path}", flush=True)
    return path
