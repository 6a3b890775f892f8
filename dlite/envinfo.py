"""The `env` block every report and benchmark JSON carries (ARCHITECTURE.md §3):
library versions and the device, so numbers from different machines are never mixed
up silently; `cpu_model` names the processor a speedup was timed on."""

import os
import platform
from pathlib import Path


def env_info() -> dict:
    import tokenizers
    import torch
    import transformers
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "device": dev, "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows (Linux names
    the model only there; elsewhere the processor or the architecture)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), None)
    return name or platform.processor() or platform.machine()
