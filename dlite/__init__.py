"""DLite: history-free speculative-decoding drafters for coding-agent LLMs.

The library half of the project: models, losses, speculative decoding, data formats
and the embedded tiny default. Pure torch + transformers; engines (Ray, DeepSpeed,
MLflow) live in `pipelines/` and `jobs/`.
"""

__version__ = "0.1.0"
