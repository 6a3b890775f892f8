"""Unit tests for pipelines.common.plots: every plot is a real PNG that draws each method /
stage in its own colour, gaps (None) do not break a plot, and bad input fails with an
error naming what is missing. `loss_curves_from_mlflow` is covered against a real
MLflow server in tests/integration/test_publish.py."""

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from pipelines.common.plots import accept_at_k_plot, loss_curves_plot, tau_by_bucket_plot, tau_vs_context_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# matplotlib's default cycle: the first three methods (sorted by name) get these colours.
C0, C1, C2 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)

METHODS = {
    "dlite": {"tau": 2.6, "accept_at_k": [0.9, 0.7, 0.5, None], "bucket_labels": ["<1K", "1K-4K", ">4K"],
              "tau_by_bucket": {"1K-4K": 2.4, "<1K": 2.8}},
    "dspark": {"tau": 2.0, "accept_at_k": [0.8, 0.5, 0.3, 0.1], "bucket_labels": ["<1K", "1K-4K", ">4K"],
               "tau_by_bucket": {"<1K": 2.1, "1K-4K": 1.9}},
}


def _pixels(path) -> np.ndarray:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    return (imread(path)[..., :3] * 255).round().astype(int)


def _has_colour(img: np.ndarray, rgb, min_pixels: int = 20) -> bool:
    return int((np.abs(img - np.array(rgb)).sum(-1) <= 6).sum()) >= min_pixels


def test_accept_at_k_draws_one_line_per_method(tmp_path):
    out = accept_at_k_plot(METHODS, tmp_path / "sub" / "accept.png")
    assert out == str(tmp_path / "sub" / "accept.png")
    img = _pixels(out)
    assert img.shape[:2] == (400, 600)
    assert _has_colour(img, C0) and _has_colour(img, C1) and not _has_colour(img, C2)


def test_tau_by_bucket_draws_grouped_bars(tmp_path):
    three = {**METHODS, "dlite_no_teacher": {**METHODS["dlite"], "tau_by_bucket": {"<1K": 2.5}}}
    img = _pixels(tau_by_bucket_plot(three, tmp_path / "tau.png"))
    assert all(_has_colour(img, c, 500) for c in (C0, C1, C2))  # bars, not just legend swatches


def test_tau_vs_context_draws_one_line_per_method(tmp_path):
    turns = lambda taus: {"by_temperature": {"0.0": {"per_task": [  # noqa: E731
        {"context_len": c, "tau": t} for c, t in zip((3000, 500, 7000), taus)]}}}
    img = _pixels(tau_vs_context_plot({"dlite": turns((2.0, 1.5, 3.0)), "dspark": turns((1.2, 1.6, 1.1))},
                                      tmp_path / "ctx.png"))
    assert _has_colour(img, C0, 200) and _has_colour(img, C1, 200) and not _has_colour(img, C2)
    with pytest.raises(ValueError, match="per-task tau"):
        tau_vs_context_plot({"dlite": {"by_temperature": {}}}, tmp_path / "none.png")


def test_loss_curves(tmp_path):
    curves = {"teacher": [(3, 2.0), (1, 3.0), (2, 2.5)], "align": [(1, 4.0), (2, 3.1)], "dspark": []}
    img = _pixels(loss_curves_plot(curves, tmp_path / "loss.png"))
    assert _has_colour(img, C0) and _has_colour(img, C1)


def test_single_method_and_all_none(tmp_path):
    one = {"dlite": {"tau": 1.0, "accept_at_k": [None, None], "tau_by_bucket": {"<1K": None}}}
    assert _pixels(accept_at_k_plot(one, tmp_path / "a.png")).size
    assert _pixels(tau_by_bucket_plot(one, tmp_path / "b.png")).size


def test_bad_input_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="no methods to plot"):
        accept_at_k_plot({}, tmp_path / "a.png")
    with pytest.raises(ValueError, match="no methods to plot"):
        tau_by_bucket_plot(None, tmp_path / "a.png")
    with pytest.raises(ValueError, match="method 'dspark' has no `accept_at_k`"):
        accept_at_k_plot({"dlite": METHODS["dlite"], "dspark": {"tau": 2.0}}, tmp_path / "a.png")
    with pytest.raises(ValueError, match="every method's tau_by_bucket is empty"):
        tau_by_bucket_plot({"dlite": {"tau_by_bucket": {}}}, tmp_path / "a.png")
    with pytest.raises(ValueError, match="no loss curves"):
        loss_curves_plot({"align": []}, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()
