"""Our feature shards in the layout SpecForge's offline trainer reads, so a peer's drafter
(SpecForge's DFlash) trains on exactly the data ours do (issue 31).

SpecForge's offline DFlash path (`specforge.runtime.data_plane.offline_reader`,
`algorithms.common.dflash_family_data.normalize_offline_sample`, read for this module)
walks a directory of `*.ckpt` files, one `torch.save`d dict per sequence:
  input_ids      int64 [seq]
  loss_mask      int64 [seq]         1 where the token is supervised (assistant)
  hidden_states  float [seq, K*H]    layer outputs concatenated in `target_layer_ids` order
Its layer convention is HF `hidden_states[i + 1]` = the output of decoder layer i, which
is what our collection stores (`dlite.decoding.capture`), so rows are copied as they are;
its loss mask means ours (a token is a training target), and its anchors (a with mask[a]
and mask[a+1]) are ours. Its trainer feeds `hidden_states` to the drafter's fc without a
cast, so they are written in the training dtype (our fp16 -> fp32 is exact).

Only `storage_mode: full` collections can be converted: DFlash reads every context row,
an `anchors` collection keeps one row per anchor."""

import json
from pathlib import Path
from typing import Optional

import torch

from dlite.data.shards import iter_records, read_manifest

MANIFEST = "dlite_source.json"  # what the directory was written from, beside the .ckpt files


def convert_shards(shards_uri: str, out_dir, dtype: torch.dtype = torch.float32,
                   expect_fingerprint=None, limit: Optional[int] = None) -> dict:
    """Write one `data_NNNNN.ckpt` per stored sequence of `shards_uri` into `out_dir`,
    then `dlite_source.json` (source manifest id, layers, counts) last: a directory
    without it is an interrupted conversion. Returns that summary."""
    m = read_manifest(shards_uri, expect_fingerprint)
    if m["storage_mode"] != "full":
        raise ValueError(f"{shards_uri}: storage_mode={m['storage_mode']!r}; SpecForge's DFlash reads "
                         f"every context row, so only a 'full' collection can be converted")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    seqs = tokens = supervised = 0
    for rec in iter_records(shards_uri, expect_fingerprint):
        if limit is not None and seqs >= limit:
            break
        n = len(rec["input_ids"])
        feats = torch.from_numpy(rec["features"]).to(dtype)
        if feats.shape != (n, m["feature_dim"]):
            raise ValueError(f"{shards_uri}: record {rec['id']} has features {tuple(feats.shape)}, "
                             f"expected ({n}, {m['feature_dim']})")
        sample = {"input_ids": torch.from_numpy(rec["input_ids"]).long(),
                  "loss_mask": torch.from_numpy(rec["loss_mask"]).long(),
                  "hidden_states": feats}
        tmp = out / f"data_{seqs:05d}.tmp"
        torch.save(sample, tmp)
        tmp.rename(out / f"data_{seqs:05d}.ckpt")  # SpecForge lists *.ckpt only: never a half file
        seqs, tokens, supervised = seqs + 1, tokens + n, supervised + int(rec["loss_mask"].sum())
    summary = {"source": str(shards_uri), "plan_id": m.get("plan_id"),
               "target_fingerprint": m["target_fingerprint"], "layer_ids": list(m["layer_ids"]),
               "hidden_size": m["hidden_size"], "dtype": str(dtype).replace("torch.", ""),
               "sequences": seqs, "tokens": tokens, "supervised_tokens": supervised}
    (out / MANIFEST).write_text(json.dumps(summary, indent=2))
    return summary


def read_summary(out_dir) -> Optional[dict]:
    """The summary of a finished conversion in `out_dir`, else None."""
    f = Path(out_dir) / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else None
