"""The typed schema of a run's configuration: one dataclass per section, composed into
`DLiteConfig`, which `dlite.config` turns into an `OmegaConf.structured` config.
Defaults describe the embedded tiny CPU run, so the schema alone is a runnable config."""

from dataclasses import dataclass, field
from typing import List, Optional

from dlite.models.config import DrafterConfig

STAGES = ["collect", "teacher", "align", "align_no_teacher", "dspark", "evaluate", "publish"]
# The stages `jobs.train` runs (align_no_teacher is `align` without its teacher input).
TRAIN_STAGES = ("teacher", "align", "dspark")
# Training-free methods an evaluation can add (eval.baselines), and the hybrids of the
# primary drafter with one of them (eval.hybrids: name -> the method it pairs with;
# the name's end is the rule: none -- the match-length rule, _choose, _tree).
BASELINES = ("prompt_lookup", "suffix")
# data.regen_history: what each turn's prompt holds before the turn -- the answers
# generated so far (as every peer regenerates), or the recorded ones: a small target's
# own agent turns degenerate into repeating its last answer (SmolLM2: 77% of regenerated
# agent turns), so each turn is instead its answer to the real history, as the held-out
# replay asks it.
REGEN_HISTORIES = ("generated", "recorded")
# data.regen_rows: what collect makes of a recorded-history regeneration -- "forked": the
# recorded conversation as an unsupervised trunk plus each answer as a branch after the
# recorded turns it answered (dlite.data.render.forked_sequences), or "conversation":
# the regenerated conversation read whole (its answers then follow answers the target
# never saw). Generated-history regenerations are always read whole (they are).
REGEN_ROWS = ("forked", "conversation")
# hybrid name -> the token drafters (eval.baselines names) it puts beside the learned one
HYBRIDS = {"hybrid_lookup": ("prompt_lookup",), "hybrid_suffix": ("suffix",),
           "hybrid_lookup_choose": ("prompt_lookup",), "hybrid_suffix_choose": ("suffix",),
           "hybrid_lookup_tree": ("prompt_lookup",), "hybrid_suffix_tree": ("suffix",),
           "hybrid_lookup_suffix_choose": ("prompt_lookup", "suffix"),
           "hybrid_lookup_suffix_tree": ("prompt_lookup", "suffix"),
           # the same rules over the token drafters alone, no learned drafter: what the
           # learned one adds to a hybrid, measured (and a hybrid needing no training)
           "hybrid_free_choose": ("prompt_lookup", "suffix"),
           "hybrid_free_tree": ("prompt_lookup", "suffix")}
FREE_HYBRIDS = ("hybrid_free_choose", "hybrid_free_tree")

@dataclass
class RunConfig:
    name: str = "tiny"
    seed: int = 0
    output_dir: str = "runs"
    stages: List[str] = field(default_factory=lambda: list(STAGES))


@dataclass
class TargetConfig:
    name: str = "tiny"
    # "builtin:tiny", "pypi:<package>" (a packaged GGUF, converted once), a local HF
    # directory, or a remote source jobs.pipeline copies first (s3://, gs://, models:/...)
    path: str = "builtin:tiny"
    num_layers: Optional[int] = None  # None: read from the target's config.json
    hidden_size: Optional[int] = None
    revision: Optional[str] = None
    # One dtype for collection, training features and evaluation (recorded, checked).
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    # "sdpa" | "sdpa_packed_gqa" (dlite.target.attention) | "eager" | None: transformers' default
    attn_implementation: Optional[str] = "sdpa"


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # None: the built-in corpus
    heldout_path: Optional[str] = None
    # The built-in corpus (dlite.corpus.build): "builtin" (synthetic JSON tool calls over the
    # stdlib), "agent" (a scripted agent running real commands, saved as mini-swe-agent /
    # SWE-agent / OpenHands runs) or "mixed"; its held-out split is built the same way.
    corpus: str = "builtin"
    extra_prompts: Optional[str] = None  # JSONL of {"turns": [...]}: one-turn conversations the target answers
    extra_prompts_limit: int = 0  # prompts taken from data.extra_prompts (0: all)
    n_train: int = 64
    n_heldout: int = 8
    # Validation rows hold out whole groups of records: a regex whose first capture group
    # of a record id names its group (`^(.+)-\d+$`: the repository of SWE-bench's
    # `<owner>__<repo>-<number>`, and of the agent corpus's `agent-<split>__<package>-<i>`),
    # so no repository is both trained on and validated; None: record by record.
    val_group: Optional[str] = None
    min_chars: int = 3000  # built-in corpus: rendered length of each trajectory
    max_chars: int = 14000
    max_seq_len: int = 2048  # the tiny corpus's system prompt + tools alone is ~700 tokens
    storage_mode: str = "full"  # "full" (every position) | "anchors" (sampled only)
    reference: str = "last_hidden"  # "last_hidden" (re-projected) | "topk" log-probs
    topk: int = 32
    anchors_per_seq: int = 16
    length_policy: str = "truncate"  # over max_seq_len: "truncate" | "split" | "drop"
    regenerate: bool = False  # re-generate assistant turns with the target (self-distillation)
    regen_max_new_tokens: int = 256
    regen_temperature: float = 0.0  # 0: greedy (the target's own most likely answers)
    regen_top_p: float = 1.0
    regen_samples: int = 1  # answers per conversation (> 1 needs regen_temperature > 0)
    regen_batch_size: int = 8  # conversations decoded together by one regeneration actor
    # Greedy only: tokens drafted per decode step by prompt lookup over the conversation
    # so far and verified in the same forward (same tokens, fewer steps); 0: off.
    regen_lookup: int = 0
    # Turn k's prompt: the answers "generated" before it (as the peers regenerate) or the
    # "recorded" ones (each answer the target's reply to the real history).
    regen_history: str = "generated"
    regen_rows: str = "forked"  # with regen_history "recorded": see REGEN_ROWS
    # Keep the target states collection needs while regenerating (its prefills read every
    # trunk token already), so `collect` runs the target only where those rows differ.
    regen_features: bool = False
    skip_other_files: bool = False  # in an input directory: skip non-trajectory files (else quarantined)
    keep_reasoning: bool = False  # keep thinking/reasoning items as assistant reasoning_content
    records_per_shard: int = 64  # record i goes to shard i // records_per_shard (resume)
    batch_tokens: int = 16384    # token budget of one padded target forward (GPU; on CPU each
                                 # sequence runs alone: dlite.data.features.forward_budget)
    shuffle_buffer: int = 256    # rows in each training rank's shuffle buffer
    cache_bytes: int = 1 << 30   # shard sets up to this size are read once and held in memory


@dataclass
class TrainConfig:
    steps_teacher: int = 20
    steps_align: int = 20
    steps_dspark: int = 20
    distill_frac: float = 0.5  # share of align steps distilling the teacher
    # Which positions train the drafters: "assistant" (the target's own replies, what it
    # generates at serving time) or "all" (every token with a next one: tool output, user
    # text, file contents too -- more copying to learn from). Needs data.storage_mode
    # "full" (anchors storage keeps features at assistant anchors only). Validation rows
    # stay on assistant positions either way, so val_tau compares across the switch, and
    # the draft vocabulary is still counted on the replies (what the target generates
    # when serving): under "all", tool and file tokens outside it count as out-of-vocabulary.
    supervise: str = "assistant"
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    batch_size: int = 4
    grad_accum: int = 1
    grad_clip: float = 1.0
    # None: the accelerator's default -- ZeRO-2 + bf16 on GPUs, ZeRO-0 + fp32 on CPU.
    zero_stage: Optional[int] = None
    precision: Optional[str] = None  # "fp32" | "bf16" | None
    eval_every: int = 10  # 0: evaluate only at the end
    skip_teacher: bool = False  # the no-teacher ablation
    # How the align stage uses the teacher (DLITE.md §3 and the authors' FlashMTP recipe):
    # "teacher_init": the student starts from the teacher's shared weights and distils it
    # with the stage-2 loss for `distill_frac` of the steps (this project's recipe);
    # "published": the student starts from scratch except its sequential head, copied
    # from the teacher and frozen for stage 1; stage 1 = `kl_weight` x KL(teacher || student).
    recipe: str = "teacher_init"
    # Share of align steps after stage 1 blending the stage-1 loss into the stage-2 loss
    # on a cosine (stage-2 weight 0 -> 1; the authors' transition epoch). 0: a hard switch.
    blend_frac: float = 0.0
    # Stage-2 loss (against the target): ce_weight x CE + tv_weight x |p_draft - p_ref|_1,
    # slot k weighted exp(-(k-1)/loss_decay) (null: every slot alike, the authors' stage 2).
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    loss_decay: Optional[float] = 4.0
    kl_weight: float = 1.0  # recipe "published", stage 1
    # CE's label: "data" (the row's next token) or "target_argmax" (the target's greedy
    # token at that position, as the authors' stage 2)
    ce_labels: str = "data"
    # The teacher stage's loss, the same terms by keys of its own: the published stage 2
    # (CE 1 + TV 1, no decay) made the dlite_v1 teacher's acceptance fall as its CE fell.
    # Defaults: the teacher's loss before these keys; the authors' teacher is CE 0.1 on
    # the target's greedy token + TV 1, decay 4 (FlashMTP run_training_dlite_teacher.sh).
    teacher_ce_weight: float = 0.1
    teacher_tv_weight: float = 0.9
    teacher_loss_decay: Optional[float] = 4.0
    teacher_ce_labels: str = "data"
    max_failures: int = 0  # Ray Train restarts before giving up


@dataclass
class LookupConfig:
    """Prompt lookup (dlite.decoding.lookup): the longest max_ngram..min_ngram match."""
    max_ngram: int = 4
    min_ngram: int = 1
    prefer: str = "last"  # "last": the most recent occurrence; "first": transformers' choice


@dataclass
class SuffixConfig:
    """SuffixDecoding (dlite.decoding.suffix, arctic-inference); the authors' defaults."""
    max_tree_depth: int = 64
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    global_tree: bool = True  # also match earlier outputs of the replayed set


@dataclass
class EvalConfig:
    n_trajectories: int = 4
    max_new_tokens: int = 32
    temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])
    buckets: List[int] = field(default_factory=lambda: [1024, 4096, 16384])
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_turns: Optional[int] = None    # assistant turns replayed per trajectory (None: all)
    min_chars: Optional[int] = None  # built-in held-out trajectories' length (None: data.*)
    max_chars: Optional[int] = None
    # "first" max_turns, "spread" evenly up to the last (long histories), or "context"
    # (spread over the turns whose history is eval.min_context..max_context tokens)
    turn_pick: str = "first"
    max_context: Optional[int] = None  # longer histories are skipped and counted
    min_context: Optional[int] = None  # turn_pick "context": pick among min..max_context-token histories
    num_workers: Optional[int] = None  # acceptance replay in parallel (None: cluster.num_workers)
    speed_trajectories: int = 2  # timed alone on one worker, plain vs speculative interleaved
    threads: int = 1  # torch threads of the timed worker (plain and speculative alike)
    # Learned drafters stop a block before the slot where their own probability that the
    # block so far is right falls below this (0: always gamma tokens); lossless either way.
    draft_stop_prob: float = 0.0
    # Also replay the primary drafter over a per-request vocabulary: its static draft
    # vocabulary | the prompt's distinct tokens (method `<primary>_ctxvocab`; needs a
    # history-free drafter with drafter.draft_vocab_size set).
    context_vocab: bool = False
    # Training-free methods replayed beside the drafters: "prompt_lookup", "suffix".
    baselines: List[str] = field(default_factory=list)
    # "hybrid_lookup" / "hybrid_suffix": the primary drafter, except in rounds where that
    # method's match is >= hybrid_min_match tokens (then its proposal is verified).
    hybrids: List[str] = field(default_factory=list)
    hybrid_min_match: int = 2
    # hybrid_*_choose / hybrid_*_tree (dlite.decoding.hybrid): what verifying m tokens
    # (anchor included) costs in decode steps, linear between these points; the default
    # is SmolLM2-135M at 4K context on this project's 2-core CPU (target_probe step costs).
    verify_cost_tokens: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    verify_cost: List[float] = field(default_factory=lambda: [1.0, 1.4, 1.6, 2.2])
    tree_budget: int = 16  # hybrid_*_tree: draft tokens one tree round may verify
    # Measure that curve instead, on this machine and target, with the calibration
    # (verifying 1..32 tokens, with eval.threads as the timed replay) after a prefill of
    # each of eval.cost_contexts tokens -- [] : the shortest, middle and longest history
    # of min_context (at least 256)..max_context, else 2048 alone -- and price each round
    # by the curve at its anchor's position, interpolated; saved as
    # report["calibration"]["cost"]. false: the figures above, at every context.
    measure_verify_cost: bool = True
    cost_contexts: List[int] = field(default_factory=list)
    # Calibration of the proposers' confidences, fitted before the reported replay on
    # this many validation trajectories (never the reported ones: built-in held-out
    # ones of seed run.seed + 1, or the data.heldout_path records after n_trajectories);
    # 0: the uncalibrated defaults. Saved in the report under "calibration".
    calibration_trajectories: int = 1
    calibration_max_turns: Optional[int] = None  # None: eval.max_turns
    # Throughput at these concurrencies (closed-loop batched decoding of held-out turns
    # with min_context..max_context tokens of history, plain batched the same way;
    # `dlite.decoding.batch`), one worker after the speed replay; [] = off.
    concurrency: List[int] = field(default_factory=list)
    concurrency_requests: Optional[int] = None  # turns decoded (None: twice the largest concurrency)
    lookup_gamma: Optional[int] = None  # tokens a training-free method may propose (None: drafter.gamma)
    # Tokens a token drafter may propose inside a hybrid (None: lookup_gamma's). A hybrid
    # verifies the prefix worth its cost, so a long copy can run on where a lone prompt
    # lookup would verify every proposed token whatever its chance.
    hybrid_gamma: Optional[int] = None
    lookup: LookupConfig = field(default_factory=LookupConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # None: start Ray locally in-process
    num_workers: int = 2
    use_gpu: bool = False
    gpus_per_worker: int = 0
    cpus_per_worker: int = 1
    backend: str = "gloo"  # "gloo" | "nccl"
    accelerator: str = "cpu"  # "cpu" | "gpu"
    storage_uri: Optional[str] = None  # None: run.output_dir on local disk


@dataclass
class TrackingConfig:
    # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db (in a Ray job: <run.output_dir>/mlflow.db)
    uri: Optional[str] = None
    experiment: Optional[str] = None  # None: dlite-<target.name>
    registered_model: Optional[str] = None  # None: dlite-<target.name>


@dataclass
class GateConfig:
    min_tau: float = 1.0
    min_speedup: float = 1.0  # slower than plain decoding: never production
    tolerance: float = 0.02  # allowed relative regression against production


@dataclass
class DLiteConfig:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    gate: GateConfig = field(default_factory=GateConfig)
