"""Engine-agnostic drafter training: the loss/metrics step (`step.py`), the optimiser
schedule and the plain-torch engine (`optim.py`), and the one readable loop (`loop.py`)
that a DeepSpeed engine (in `pipelines/`) can drive unchanged."""
