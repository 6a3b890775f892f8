"""Trajectory data for drafter training, pure Python/torch (no Ray):

- `formats`  -- input planning and reading (JSONL, Parquet, HF datasets dirs, `.traj.json`
                dirs), adapters to canonical OpenAI messages, validation -> `Quarantine`.
- `render`   -- chat-template rendering, per-token loss masks, the length policy, and the
                optional `Regenerator` (self-distillation of assistant turns).
- `anchors`  -- anchor sampling where both the anchor and the next token are supervised.
- `features` -- the target forward with hooks on the captured layers + reference signal.
- `shards`   -- the feature-shard schema, manifest, atomic writer, checksums, readers.
- `draft_vocab` -- choosing a drafter's draft vocabulary from supervised token counts.

`pipelines/stages/collect.py` runs these on Ray Data; the train stage reads shards through
`shards.iter_records` (or `pipelines.stages.collect.read_shards` for a Ray Dataset).
"""
