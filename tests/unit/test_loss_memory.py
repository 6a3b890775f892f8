"""dlite.bench.loss_memory at a toy size: the chunked loss really touches less memory
than the one-shot one (two fresh subprocesses, a few seconds), and the report's
extrapolation and goal are the stated arithmetic on the measured points."""

import sys

import pytest
import torch

from dlite.bench import loss_memory

TOY = dict(vocab=32768, draft_vocab=8192, hidden=64, gamma=4, dtype="bfloat16", chunk_rows=32)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_chunked_loss_touches_less_memory_than_one_shot():
    # 256 rows: the one-shot loss holds two fp32 [256, 32768] blocks (64 MiB) at its
    # peak; the chunked one a chunk (32 rows) and the bf16 logits gradient (4 MiB).
    got = {p: loss_memory._spawn(path=p, rows=256, **TOY)["loss_activation_bytes"] for p in loss_memory.PATHS}
    assert got["unchunked"] >= 2 * 256 * 32768 * 4 * 0.9
    assert 0 < got["chunked"] < got["unchunked"] / 2


def test_report_extrapolates_the_measured_line(monkeypatch):
    fake = {"unchunked": (1000, 300), "chunked": (5000, 10)}   # intercept, bytes per row
    monkeypatch.setattr(loss_memory, "_spawn", lambda path, rows, **kw: {
        "rows": rows, "loss_activation_bytes": fake[path][0] + fake[path][1] * rows})
    report = loss_memory.run(rows_list=(96, 128), **{**TOY, "dtype": torch.bfloat16}, batch=2, anchors=8)
    ex = report["extrapolated"]
    assert report["production"]["rows"] == 2 * 8 * 4
    assert ex["unchunked"]["loss_activation_bytes"] == 1000 + 300 * 64
    assert ex["chunked"] == {"intercept_bytes": 5000, "bytes_per_row": 10.0, "loss_activation_bytes": 5640}
    assert report["goal"]["met"] and "arithmetic" in report["arithmetic"]["label"]
    for too_few in ((16, 128), (64, 128)):                      # < chunk_rows, <= hidden
        with pytest.raises(ValueError, match="chunk_rows"):
            loss_memory.run(rows_list=too_few, **{**TOY, "dtype": torch.bfloat16})
