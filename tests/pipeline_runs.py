"""What several tests' pipeline runs share: the smallest stage list that still trains,
evaluates and publishes, and finished stages linked into a new run's output dir (the
`smoke_collection` fixture in conftest.py makes the one they reuse)."""

from pathlib import Path

# The smallest pipeline that still collects, trains, evaluates and publishes (the DLite
# drafter only, no teacher): the runs whose point is where they run (a Ray job) or who
# may write (authenticated MLflow), not the drafter.
SMALLEST_STAGES = ["run.stages=[collect,align,evaluate,publish]", "train.skip_teacher=true"]


def seed_stages(output_dir: Path, *stage_dirs: Path) -> None:
    """Finished stage dirs linked into `output_dir/stages/` (read only by what runs there:
    a reused stage is never written to)."""
    (output_dir / "stages").mkdir(parents=True, exist_ok=True)
    for d in stage_dirs:
        (output_dir / "stages" / d.name).symlink_to(d, target_is_directory=True)
