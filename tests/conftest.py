import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# subprocesses (DDP ranks, CLI runs) import this checkout's package and the test helpers
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("PL_DISABLE_FORK", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
