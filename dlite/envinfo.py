"""The `env` block every report and benchmark JSON carries (ARCHITECTURE.md §3):
library versions and the device, so numbers from different machines are never mixed
up silently."""

import os
import platform


def env_info() -> dict:
    import tokenizers
    import torch
    import transformers
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "device": dev, "torch_threads": torch.get_num_threads(), "platform": platform.platform()}
