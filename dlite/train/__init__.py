"""Engine- and cluster-free drafter training: batches (`data.py`: collation and the
resumable `BatchStream`), the loss/metrics step and validation (`step.py`), the
optimiser schedule and the plain-torch engine (`optim.py`), the one readable loop
(`loop.py`) and what each stage trains (`stage.py`: teacher / align / dspark). The
Ray Train + DeepSpeed adapter in `pipelines/stages/train.py` drives these unchanged."""
