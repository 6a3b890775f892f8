"""The PNG plots an evaluation or publish run logs to MLflow (ARCHITECTURE.md §3, §5):

  accept_at_k_plot     acceptance per draft slot, one line per method (greedy)
  tau_by_bucket_plot   tau per context-length bucket, grouped bars per method (greedy)
  loss_curves_plot     training loss per stage, from `loss_curves_from_mlflow`
  by_concurrency_plot  a throughput figure against concurrency, one line per method

`methods` is `{name: metrics}` as `dlite.card.report_methods` returns it. Figures are
built on `matplotlib.figure.Figure` with the Agg canvas, never pyplot: no global figure
registry, so Ray workers and tests can plot concurrently without leaking state.
"""

import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dlite.card import finite
from pipelines.common import tracking
Curve = Sequence[Tuple[int, float]]  # (step, value) points


def _check_methods(methods: dict, key: str) -> None:
    if not isinstance(methods, dict) or not methods:
        raise ValueError(f"plot: no methods to plot (expected {{name: metrics}} with `{key}`)")
    for name, r in methods.items():
        if not isinstance(r, dict) or key not in r:
            raise ValueError(f"plot: method {name!r} has no `{key}`")


def _save(fig: Figure, path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # attaches itself to fig: PNG through Agg whatever the default backend
    fig.savefig(path, format="png", dpi=100)
    return str(path)


def _nan(x) -> float:
    v = finite(x)
    return math.nan if v is None else v  # a gap in the line, not a fake zero


def accept_at_k_plot(methods: Dict[str, dict], path) -> str:
    """Share of rounds accepting draft slot k (1..gamma), one line per method."""
    _check_methods(methods, "accept_at_k")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, r in sorted(methods.items()):
        ys = [_nan(a) for a in r["accept_at_k"] or []]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set(xlabel="draft slot k", ylabel="accept@k (greedy)", ylim=(0, 1.02),
           title="Acceptance per draft slot")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def tau_vs_context_plot(methods: Dict[str, dict], path, temperature: str = "0.0") -> str:
    """tau of every replayed turn against its context length, one line per method (the
    same turns for every method, so the lines compare turn by turn)."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for name in sorted(methods):
        tasks = (methods[name].get("by_temperature", {}).get(temperature) or {}).get("per_task") or []
        pts = sorted((t["context_len"], t["tau"]) for t in tasks if t.get("tau") is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
    if not ax.lines:
        raise ValueError(f"plot: no method has per-task tau at temperature {temperature}")
    ax.set(xlabel="context length (tokens)", ylabel=f"tau (T={temperature})", title="tau against context length")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(4, len(ax.lines)))
    return _save(fig, path)


def _bucket_order(methods: Dict[str, dict]) -> List[str]:
    """Buckets holding any method's rounds, in report order (short contexts first)."""
    order: List[str] = []
    for r in methods.values():
        for b in list(r.get("bucket_labels") or []) + list(r["tau_by_bucket"] or {}):
            if b not in order:
                order.append(b)
    return [b for b in order if any(b in (r["tau_by_bucket"] or {}) for r in methods.values())]


def tau_by_bucket_plot(methods: Dict[str, dict], path) -> str:
    """tau per context-length bucket, one bar per method in each bucket."""
    _check_methods(methods, "tau_by_bucket")
    labels = _bucket_order(methods)
    if not labels:
        raise ValueError("plot: every method's tau_by_bucket is empty")
    # Wider with more bars per bucket, taller with more legend rows (3 names per row).
    rows = -(-len(methods) // 3)
    fig = Figure(figsize=(max(6, 1.5 * len(labels), 0.45 * len(labels) * len(methods)), 3.6 + 0.3 * rows),
                 layout="constrained")
    ax = fig.add_subplot()
    names = sorted(methods)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        tb = methods[name]["tau_by_bucket"] or {}
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, [_nan(tb.get(b)) for b in labels], width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8 if len(names) <= 4 else 6)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(xlabel="context length (tokens)", ylabel="tau (greedy)", title="tau by context length")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.1)
    fig.legend(loc="outside lower center", ncols=min(3, len(names)))  # below the axes: never over a bar
    return _save(fig, path)


def by_concurrency_plot(methods: Dict[str, Dict[str, dict]], key: str, ylabel: str, path) -> str:
    """`key` against concurrency, one line per method that reports it (the throughput
    benchmark's {method: {str(concurrency): figures}}); log2 x axis (1, 2, 4, ...)."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for name in methods:
        pts = sorted((int(c), _nan(r.get(key))) for c, r in methods[name].items() if key in r)
        if any(not math.isnan(y) for _, y in pts):  # plain has no speedup over itself
            ax.plot(*zip(*pts), marker="o", label=name)
    if not ax.lines:
        raise ValueError(f"plot: no method reports `{key}`")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel=ylabel, title=f"{ylabel} by concurrency")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(3, len(ax.lines)))
    return _save(fig, path)


def loss_curves_plot(curves: Dict[str, Curve], path) -> str:
    """Training loss against step, one line per stage."""
    if not isinstance(curves, dict) or not any(curves.values()):
        raise ValueError("plot: no loss curves to plot (expected {stage: [(step, value), ...]})")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, pts in sorted(curves.items()):
        if pts:
            steps, values = zip(*sorted(pts))
            ax.plot(steps, values, label=name)
    ax.set(xlabel="step", ylabel="training loss", title="Training loss per stage")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def loss_curves_from_mlflow(uri: str, run_ids: Dict[str, str], key: str = "loss") -> Dict[str, Curve]:
    """{name: [(step, value), ...]} from each run's metric history (empty when never logged)."""
    c = tracking.client(uri)
    return {name: sorted((m.step, m.value) for m in c.get_metric_history(run_id, key))
            for name, run_id in run_ids.items()}
