"""The choose / tree hybrids' calibration for the evaluation stage: fitted on one Ray
worker before the reported replay, on validation turns -- never on the reported ones
(`data.heldout_path` records past the first `eval.n_trajectories`, or built-in held-out
trajectories of another seed) -- with the primary drafter (`dlite.decoding.calibrate`).
The evaluation report keeps it as `report["calibration"]`."""

from typing import Dict

import ray
from omegaconf import OmegaConf


def calibration_set(cfg) -> list:
    """Validation trajectories for the hybrids' calibration, never the reported ones: the
    `data.heldout_path` records after the first `eval.n_trajectories`, or built-in
    held-out trajectories of another seed (run.seed + 1)."""
    k, n = cfg.eval.calibration_trajectories, cfg.eval.n_trajectories
    if cfg.data.heldout_path:
        from dlite.data.heldout import read_heldout
        return read_heldout(cfg.data.heldout_path, n + k, cfg.data.keep_reasoning)[0][n:]
    from dlite.corpus import build
    lo, hi = cfg.eval.min_chars or cfg.data.min_chars, cfg.eval.max_chars or cfg.data.max_chars
    return build.heldout_records(cfg.data.corpus, k, cfg.run.seed + 1, lo, hi)


def default_or_none(cfg):
    """(True, what to use) when no fit is needed -- None: no choose / tree hybrid; the
    defaults: `eval.calibration_trajectories` 0 -- else (False, None)."""
    from dlite.decoding.calibrate import scored_token_methods
    from dlite.decoding.calibration import Calibration
    if not scored_token_methods(cfg.eval.hybrids):
        return True, None
    if not cfg.eval.calibration_trajectories:
        return True, Calibration().to_dict()
    return False, None


def fit_here(cfg, model, tok, learned: dict, vocab: int, records: list) -> dict:
    """The fit in this process, with the primary (first) learned drafter set up as
    `method_builders` sets it."""
    from dlite.decoding.calibrate import fit_calibration
    primary = next(iter(learned.values()))
    primary.draft_stop_prob = cfg.eval.draft_stop_prob
    return fit_calibration(model, tok, cfg.eval, primary, vocab, records, cfg.eval.calibration_max_turns)


def hybrid_calibration(cfg, conf: dict, drafters: Dict[str, str], gpus) -> dict:
    """The choose / tree hybrids' calibration, fitted on one worker before the reported
    replay (None: no such hybrid; `eval.calibration_trajectories` 0: the defaults)."""
    done, cal = default_or_none(cfg)
    if done:
        return cal
    records = calibration_set(cfg)
    print(f"[evaluate] calibrating {list(cfg.eval.hybrids)} on {len(records)} validation trajectories", flush=True)
    task = ray.remote(num_cpus=1, num_gpus=gpus)(_calibrate)
    return ray.get(task.remote(conf, drafters, records))


def _calibrate(cfg_dict: dict, drafters: Dict[str, str], records: list) -> dict:
    """One worker: the hybrids' calibration fitted on validation `records` with the
    primary drafter (`dlite.decoding.calibrate`)."""
    # Imported here, in the worker: the evaluation stage imports this module.
    from pipelines.stages.evaluate import _load
    cfg = OmegaConf.create(cfg_dict)
    # Alone on the machine (before the acceptance workers): eval.threads, as the timed
    # replay, which is also what the measured cost curve must be timed with.
    model, tok, learned, vocab = _load(cfg, drafters, cfg.eval.threads)
    return fit_here(cfg, model, tok, learned, vocab, records)
