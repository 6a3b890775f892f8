"""The quality benchmark's settings over a pipeline config, and its ratio helper: shared
by the benchmark and its ablations (which it runs), so neither imports the other's module."""
from omegaconf import OmegaConf

from dlite.config_schema import STAGES as PIPELINE_STAGES

STAGES = [s for s in PIPELINE_STAGES if s != "publish"]


def bench_config(cfg, window: int = 1536, budget=None):
    """The benchmark's settings over `cfg` (which keeps sizes and the cluster; its
    train.steps_* too when `budget` is None)."""
    t = cfg.train
    steps = ({"steps_teacher": budget // 2, "steps_align": budget - budget // 2, "eval_every": max(1, budget // 4)}
             if budget else {})
    over = {"run": {"stages": STAGES, "name": f"{cfg.run.name}-quality"},
            "data": {"max_seq_len": window, "length_policy": "split"},
            "train": {**steps, "steps_dspark": budget or t.steps_teacher + t.steps_align},
            "eval": _heldout(cfg.eval)}
    from dlite.config import validate
    out = OmegaConf.merge(cfg, over)
    validate(out)
    return out


def _heldout(e) -> dict:
    """Which held-out turns the benchmark replays. A target with a position limit (its
    experiment sets `eval.max_context`, e.g. SmolLM2's 8K): turns picked by context
    length from 0 to that limit (`turn_pick=context`), so every bucket up to it gets
    turns; the experiment's trajectory lengths stay. Otherwise (the tiny target): the
    built-in corpus renders ~3.3 characters per token, so 40-52K characters put the
    last turns' histories at 12-16K tokens, 8-10x a 1536 window, turns spread to the last."""
    if e.max_context:
        return {"turn_pick": "context", "min_context": 0, "max_turns": e.max_turns or 4}
    return {"turn_pick": "spread", "max_turns": 4, "max_context": None,
            "min_chars": e.min_chars or 40000, "max_chars": e.max_chars or 52000}


def ratio(a, b):
    """a / b rounded, None when either is missing."""
    from dlite.decoding.metrics import ratio as exact
    r = exact(a, b)
    return None if r is None else round(r, 4)
