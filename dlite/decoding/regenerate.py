"""Batched regeneration of assistant turns by the target (self-distillation, DLITE.md §3
"Data"): the conversations `dlite.data.render.HFRegenerator` produces (each assistant
turn replaced, left to right, by the target's continuation of the history so far, tool
results as recorded) at a fraction of its cost.

  rows     one per (conversation, sample), each with its OWN batch-1 KV cache;
  prefill  per row, unpadded, only what its cache lacks: a new row starts from a copy of
           the prompt prefix it shares with earlier rows (an agent corpus repeats one
           system prompt + tool schemas) when >= SHARE_MIN tokens; turn k+1's prompt,
           where it extends the cached tokens (turn k's prompt + answer), costs only the
           new tool / user text + the generation prompt; where not (text re-tokenised
           otherwise) the cache is cropped to the common prefix (`prefix_misses`);
  decode   up to `batch_size` rows due a turn, stacked LEFT-padded into one cache with
           room for the turn (mask + per-row positions), in lockstep; a row stops on any
           EOS id of the generation config or at `max_new_tokens` and its slice goes back
           to its own cache; the next conversation takes a finished one's place.
  history  "generated" (default): turn k's prompt holds the answers generated before it;
           "recorded": the recorded turns instead (its cache is cropped back to where
           they differ, so each turn re-prefills the last recorded answer + new text).
  lookup   (greedy, `lookup` > 0) each step also feeds every row its prompt-lookup draft
           over its own conversation so far (SmolLM2 re-quotes files and its own earlier
           answers), padded to the longest; the drafts equal to the target's argmax are
           kept, the rest stay in the cache but masked out (a lone row crops them), so a
           step yields 1 + accepted tokens per row, and the tokens are greedy's.
  capture  (`capture`: a `dlite.data.regen_features.StateCapture`) the prefills keep the
           states collection needs, and a finished conversation comes back with its
           training rows (`features`), so `collect` need not run the target over it again.
Exactness (fp32): a batched step's logits differ from batch-1's in the last bits (~1e-6:
BLAS sums a 4-row product in another order than a 1-row one), as HF's re-prefill differs
from a carried cache; greedy tokens were identical in every comparison made
(tests/unit/test_regenerate.py, `jobs.benchmark regenerate`): they can part only where
two logits tie within that noise. Unusable records come back as quarantine entries
(`too_long`, `template_error`, `empty_answer`), never as exceptions.
torch + transformers only: the Ray stage (pipelines/stages/regenerate.py) wraps it."""

import time
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from dlite.config_schema import REGEN_HISTORIES
from dlite.data import chat
from dlite.data.formats import Quarantine
from dlite.data.regen_features import RowStates, common_prefix
from dlite.decoding.decode import _device, crop_cache, target_forward
from dlite.target.cache import cache_kwarg, new_cache
from dlite.decoding.lookup import lookup_proposal
from dlite.decoding.stacked_cache import select, stack, unstack
from dlite.decoding.verify import sample_token, verify_greedy

SHARE_MIN = 32  # shorter common prefixes are not worth a cache copy
# Prompt lookup's n-gram lengths (max, min) when drafting: a 1-token match proposes
# mostly wrong blocks, and every row of a step pays for the longest block in it.
LOOKUP_NGRAM = (4, 2)


@dataclass
class _Row:
    """One (conversation, sample) being regenerated."""
    rec: dict
    sample: int
    generator: Optional[torch.Generator]
    out: list = field(default_factory=list)  # the regenerated conversation so far
    at: int = 0                               # next input message to read
    ids: List[int] = field(default_factory=list)  # tokens whose keys/values `cache` holds
    cache: object = None
    logits: Optional[torch.Tensor] = None  # the next token's, after a prefill
    turns: int = 0
    tokens: List[List[int]] = field(default_factory=list)  # each turn's generated ids
    failed: Optional[Quarantine] = None
    states: Optional[RowStates] = None  # with a capture: the states of cache positions


class BatchedRegenerator:
    """Regenerates many conversations at once (see the module docstring). Greedy at
    temperature 0; else nucleus sampling with one seeded generator per (record, sample),
    so a row's tokens do not depend on which rows share its batch."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, samples: int = 1, batch_size: int = 8, seed: int = 0,
                 lookup: int = 0, history: str = "generated", capture=None):
        from dlite.target import eos_ids
        if any(layer.is_sliding for layer in new_cache(model).layers):
            # Stacked and split caches are plain full-attention layers.
            raise ValueError(f"{type(model).__name__}: sliding-window caches are not supported")
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        # Draft tokens per step from prompt lookup; greedy only: sampling keeps its stream.
        self.lookup = max(0, int(lookup)) if temperature <= 0 else 0
        if history not in REGEN_HISTORIES:
            raise ValueError(f"history must be one of {REGEN_HISTORIES}, got {history!r}")
        self.history, self.capture = history, capture
        self.eos = set(eos_ids(model, tokenizer))
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.stats = dict(records=0, turns=0, tokens_generated=0, prefill_tokens=0,
                          prefill_s=0.0, decode_s=0.0, decode_steps=0, prefix_misses=0,
                          shared_prefix_tokens=0, drafted=0, accepted=0, feature_rows=0,
                          feature_tokens_kept=0, feature_tokens_run=0, feature_s=0.0)
        # (ids, batch-1 cache, its kept states): the prompt prefix new rows start from
        self._shared = None

    # ------------------------------------------------------------ public

    def regenerate(self, messages: list, tools: list) -> list:
        """One conversation (the `dlite.data.render.Regenerator` protocol); raises Quarantine."""
        done, bad = self.regenerate_many([{"id": "r", "messages": messages, "tools": tools}])
        if bad:
            raise Quarantine(bad[0]["reason"], bad[0]["detail"])
        return done[0]["messages"]

    def regenerate_many(self, records: List[dict]) -> Tuple[List[dict], List[dict]]:
        """(regenerated records, quarantine entries), in input order. A record is
        {"id", "messages", "tools", ...}; each output keeps its other keys and adds
        `sample`, `turns` and `tokens` (each turn's generated ids, the stopping EOS
        included); past the first sample the id becomes `<id>#s<k>`."""
        queue = [_Row(r, k, self._generator(r["id"], k)) for r in records for k in range(self.samples)]
        live: List[_Row] = []
        done: dict = {}
        self.stats["records"] += len(records)
        while queue or live:
            while queue and len(live) < self.batch_size:
                live.append(queue.pop(0))
            due = []
            for row in live:
                res = self._advance(row)
                if res is None:
                    due.append(row)
                else:
                    done[(row.rec["id"], row.sample)] = res
            live = due
            if due:
                self._turn(due)
        return self._collate(records, done)

    def _collate(self, records: List[dict], done: dict) -> Tuple[List[dict], List[dict]]:
        """A record with any failed sample is quarantined whole (its first failure's
        reason), so the caller's `read = written + quarantined` counts records."""
        ok, bad = [], []
        for r in records:
            res = [done[(r["id"], k)] for k in range(self.samples)]
            failed = [x for x in res if "reason" in x]
            if failed:
                bad.append(failed[0])
            else:
                ok += res
        return ok, bad

    # ------------------------------------------------------------ one row

    def _generator(self, rid: str, sample: int) -> Optional[torch.Generator]:
        if self.temperature <= 0:
            return None
        g = torch.Generator(device=_device(self.model))
        g.manual_seed(zlib.crc32(f"{self.seed}:{rid}:{sample}".encode()))
        return g

    def _finish(self, row: _Row, q: Optional[Quarantine] = None) -> dict:
        rec = row.rec
        if q is not None:
            row.cache = None  # its memory goes back before the next conversation is admitted
            return {"index": rec.get("index"), "id": rec["id"], "where": rec.get("where"),
                    "sample": row.sample, "reason": q.reason, "detail": q.detail}
        rid = rec["id"] if row.sample == 0 else f"{rec['id']}#s{row.sample}"
        # With the recorded history the answers were written after the recorded turns, not
        # after each other: the recorded conversation goes along (collect's forked rows).
        recorded = {"recorded_messages": rec["messages"]} if self.history == "recorded" else {}
        res = {**rec, "id": rid, "sample": row.sample, "messages": row.out, "turns": row.turns,
               "tokens": row.tokens, **recorded}
        if self.capture is not None:  # before the cache goes: collection's rows run on it
            t0 = time.perf_counter()
            res["features"], kept, ran = self.capture.finish(row.states, res, row.cache, row.ids)
            self.stats["feature_rows"] += len(res["features"])
            self.stats["feature_tokens_kept"] += kept  # read from the prefills' states
            self.stats["feature_tokens_run"] += ran    # the answers, the last turn, misses
            self.stats["feature_s"] += time.perf_counter() - t0
        row.cache, row.states = None, None
        return res

    def _advance(self, row: _Row) -> Optional[dict]:
        """Copy recorded messages up to the next assistant turn and prefill its prompt:
        None when the row is due a turn, else its final result (done or quarantined)."""
        if row.failed is not None:
            return self._finish(row, row.failed)
        msgs = row.rec["messages"]
        while row.at < len(msgs) and msgs[row.at]["role"] != "assistant":
            row.out.append(msgs[row.at])
            row.at += 1
        upto = row.at  # the recorded history before the turn generated now
        if row.at < len(msgs):
            row.at += 1  # the recorded assistant turn, replaced by the one generated now
        elif row.out and row.out[-1]["role"] == "assistant":
            return self._finish(row)
        history = row.out if self.history == "generated" else msgs[:upto]
        try:
            text = chat.render(self.tok, history, row.rec.get("tools"), True)
        except Exception as e:  # a template that cannot render this history
            return self._finish(row, Quarantine("template_error", f"turn {row.turns}: {e}"))
        prompt = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(prompt) >= self.max_positions:
            return self._finish(row, Quarantine(
                "too_long", f"turn {row.turns}: a {len(prompt)}-token history, the target has "
                            f"{self.max_positions} positions"))
        self._prefill(row, prompt)
        return None

    @torch.inference_mode()
    def _prefill(self, row: _Row, prompt: List[int]) -> None:
        """Run the part of `prompt` the row's cache lacks; keeps the last logits on the row."""
        if row.cache is None:
            row.cache, keep = self._start(row, prompt)
        else:
            same = common_prefix(row.ids, prompt[:-1])
            # with a capture, from the first position without kept states (the decode
            # steps fed the last answer; it is run again, as collection would)
            keep = same if self.capture is None else min(same, row.states.n)
            self.stats["prefix_misses"] += int(same < len(row.ids))
            if keep < len(row.ids):
                crop_cache(row.cache, keep)
        t0 = time.perf_counter()
        ids = torch.tensor(prompt[keep:], device=_device(self.model))
        if self.capture is None:
            row.logits = target_forward(self.model, ids, keep, row.cache, logits_to_keep=1)[-1]
        else:
            row.logits = self.capture.prefill(row.states, ids, keep, row.cache)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_tokens"] += len(prompt) - keep
        if self._shared is None:
            self._shared = (list(prompt), unstack(row.cache, 0, slice(0, len(prompt))),
                            row.states.head(len(prompt)) if self.capture is not None else None)
        row.ids = list(prompt)

    def _start(self, row: _Row, prompt: List[int]):
        """A new row's (cache, tokens it holds): a copy of the shared prefix when this
        prompt begins with >= SHARE_MIN of its tokens (agent corpora repeat one system
        prompt + tool schemas in every conversation), else an empty cache. The shared
        prefix shrinks to what the prompts sharing it have in common. With a capture the
        row's kept states start as the prefix's."""
        if self._shared is not None:
            ids, cache, states = self._shared
            c = common_prefix(ids, prompt[:-1])
            if c >= SHARE_MIN:
                if c < len(ids):
                    self._shared = (ids[:c], unstack(cache, 0, slice(0, c)), states and states.head(c))
                self.stats["shared_prefix_tokens"] += c
                row.states = states and states.head(c)
                return unstack(cache, 0, slice(0, c)), c
        row.states = RowStates() if self.capture is not None else None
        return new_cache(self.model), 0

    def _pick(self, logits: torch.Tensor, row: _Row) -> int:
        return sample_token(logits, self.temperature, self.top_p, 0, row.generator)

    # ------------------------------------------------------------ one batched turn

    @torch.inference_mode()
    def _turn(self, rows: List[_Row]) -> None:
        """Decode one assistant turn for every row, stacked; a row that stops leaves the
        batch at once (its valid columns split back), so the others' steps stop paying
        for it. Each step feeds every row its last token plus its lookup draft (none when
        `lookup` is 0 or sampling), padded to the longest: greedy verification keeps the
        drafts that equal the target's own argmax, so the tokens are plain greedy's."""
        lens = [len(r.ids) for r in rows]
        budget = [min(self.max_new_tokens, self.max_positions - n) for n in lens]
        outs = [[self._pick(r.logits, r)] for r in rows]
        t0 = time.perf_counter()
        if len(rows) == 1:  # its own cache: rejected drafts are cropped, not masked
            cache, mask = rows[0].cache, None
        else:
            cache, mask = stack([r.cache for r in rows], lens, max(budget) + self.lookup + 1)
            mask = mask.to(_device(self.model))
            for r in rows:  # the stacked copy is the only one until the turn is split back
                r.cache = None
        active, steps = list(range(len(rows))), 0  # batch row b decodes rows[active[b]]
        while True:
            stopped = [b for b, i in enumerate(active) if outs[i][-1] in self.eos or len(outs[i]) >= budget[i]]
            for b in stopped:
                i = active[b]
                fed = lens[i] + len(outs[i]) - 1  # prompt + answer bar its last token
                if mask is None and cache.get_seq_length() > fed:  # it stopped inside its drafts
                    crop_cache(cache, fed)
                cols = slice(0, fed) if mask is None else mask[b].nonzero().flatten()[:fed]
                self._answer(rows[i], outs[i], cache, b, cols)
            active = [i for b, i in enumerate(active) if b not in stopped]
            if not active:
                break
            if stopped:
                keep = [b for b in range(len(active) + len(stopped)) if b not in stopped]
                select(cache, keep)
                mask = mask[keep]
            drafts = [self._draft(rows[i], outs[i], budget[i]) for i in active]
            n = 1 + max(map(len, drafts))
            blocks = [[outs[i][-1], *d] + [0] * (n - 1 - len(d)) for i, d in zip(active, drafts)]
            logits = self._step(cache, mask, blocks, [lens[i] + len(outs[i]) - 1 for i in active],
                                [1 + len(d) for d in drafts])
            steps += 1
            kept = [self._accept(rows[i], outs[i], d, logits[b], budget[i])
                    for b, (i, d) in enumerate(zip(active, drafts))]
            if mask is not None:  # a row's fed token and its accepted drafts stay visible
                new = torch.arange(n, device=mask.device)[None, :] < torch.tensor(kept, device=mask.device)[:, None]
                mask = torch.cat([mask, new.long()], dim=1)
            elif kept[0] < n:
                crop_cache(cache, cache.get_seq_length() - (n - kept[0]))
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += steps

    def _draft(self, row: _Row, out: List[int], budget: int) -> List[int]:
        """The row's prompt-lookup draft after `out` (never past its budget; `self.lookup`
        is 0 when sampling)."""
        room = min(self.lookup, budget - len(out))
        if room <= 0:
            return []
        seq = torch.tensor(row.ids + out)
        draft, _ = lookup_proposal(seq, room, *LOOKUP_NGRAM)
        self.stats["drafted"] += len(draft)
        return draft

    def _accept(self, row: _Row, out: List[int], draft: List[int], logits: torch.Tensor, budget: int) -> int:
        """Extend `out` by the accepted drafts and the target's next token, stopping at an
        EOS or the budget; returns how many of the block's columns stay (1 + accepted)."""
        if draft:  # greedy only (see `_draft`): the decoding loop's own rule
            a, nxt = verify_greedy(torch.tensor(draft), logits[:len(draft) + 1])
            self.stats["accepted"] += a
        else:
            a, nxt = 0, self._pick(logits[0], row)
        for tok in draft[:a] + [nxt]:
            out.append(tok)
            if tok in self.eos or len(out) >= budget:
                break
        return 1 + a

    def _step(self, cache, mask, blocks: List[List[int]], start: List[int], real: List[int]) -> torch.Tensor:
        """One forward of every row's block at its own positions: logits [B, n, V]. A
        row's padding sits at its last real position (never past the target's limit);
        its real tokens never see it (it comes after them) and it is masked out after."""
        dev, n = _device(self.model), len(blocks[0])
        kw = {cache_kwarg(type(self.model)): cache}
        if mask is not None:
            kw["attention_mask"] = torch.nn.functional.pad(mask, (0, n), value=1)
        step = torch.arange(n, device=dev)[None, :].minimum(torch.tensor(real, device=dev)[:, None] - 1)
        pos = torch.tensor(start, device=dev)[:, None] + step
        out = self.model(input_ids=torch.tensor(blocks, device=dev), position_ids=pos, use_cache=True,
                         logits_to_keep=n, **kw)
        return out.logits

    def _answer(self, row: _Row, toks: List[int], cache, i: int, cols) -> None:
        """Row i's turn: the answer appended (its text without the stopping EOS), the
        cache columns of prompt + answer (bar the last token, never fed) kept as the row's."""
        if row.cache is not cache:
            row.cache = unstack(cache, i, cols)
        row.ids = row.ids + toks[:-1]
        row.turns += 1
        row.tokens.append(toks)
        self.stats["turns"] += 1
        self.stats["tokens_generated"] += len(toks)
        text = self.tok.decode(toks[:-1] if toks[-1] in self.eos else toks, skip_special_tokens=False)
        if not text.strip():
            row.failed = Quarantine("empty_answer", f"turn {row.turns - 1}: nothing generated")
        row.out.append({"role": "assistant", "content": text})
