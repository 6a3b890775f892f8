"""Joining or starting Ray: one place, so every stage connects the same way."""
import os

import ray


def init_ray(cfg) -> None:
    """Join `cluster.address`, else $RAY_ADDRESS (set by `ray job submit`), else start
    Ray locally in this process -- never an unrelated `ray start` cluster found on the
    machine. A no-op when Ray is already up."""
    if not ray.is_initialized():
        address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or "local"
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
