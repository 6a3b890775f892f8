"""`python -m jobs.benchmark collect` end to end, in-process on the session's local Ray
(so it starts no second Ray) against the random-weight target: two records,
one repetition; the report has every section with positive figures."""

import json

from jobs import benchmark


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_collect_benchmark_report(ray_session, random_target, tmp_path):
    out = tmp_path / "collect.json"
    rc = benchmark.main(["collect", "--config", "configs/experiments/tiny.yaml", "--out", str(out),
                         "--rounds", "1", f"target.path={random_target}", "data.n_train=2"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"capture_overhead", "bytes_per_token", "collect_scaling", "config", "env"} <= set(report)

    cap = report["capture_overhead"]
    assert cap["repetitions"] == 1 and len(cap["bare_s"]) == len(cap["collect_s"]) == 1
    assert all(_positive(cap[k]) for k in ("ratio", "bare_tokens_per_s", "collect_tokens_per_s"))

    bpt = report["bytes_per_token"]
    for combo in ("full+last_hidden", "full+topk", "anchors+last_hidden", "anchors+topk"):
        assert _positive(bpt[combo]["bytes_per_token"])
    # full keeps every position: K*H + H fp16 values per token, exactly DeepSpec's size.
    assert bpt["full+last_hidden"]["bytes_per_token"] == bpt["deepspec"]["bytes_per_token"]
    assert bpt["anchors+topk"]["bytes_per_token"] < bpt["full+topk"]["bytes_per_token"]
    assert _positive(bpt["deepspec_over_anchors_topk"])

    for a in ("actors_1", "actors_2"):
        run = report["collect_scaling"][a]
        assert run["records"] == 2 and _positive(run["records_per_s"]) and _positive(run["tokens_per_s"])
    assert report["config"]["target"]["path"] == random_target and report["env"]["torch"]
