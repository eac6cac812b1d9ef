"""Stand-ins for Flower's ClientApp runner in a warm parent's children (``--target tests.warm_targets:act``):
the task's token says what the child does, so the parent's handling of each outcome is tested without a
SuperNode."""

import json
import os
import sys
import time
from typing import Any


def act(spec: dict[str, Any]) -> None:
    """``report:PATH`` writes what the child sees (its random draws, which project modules it has imported);
    ``raise`` raises; ``exit:N`` ends the process at once with code N; ``hang`` sleeps for an hour."""
    what, _, argument = spec["token"].partition(":")
    if what == "report":
        import numpy
        import torch

        seen = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "torch": torch.rand(3).tolist(),
            "numpy": numpy.random.random_sample(3).tolist(),
            "project": sorted(name for name in sys.modules if name.partition(".")[0] == "alignfl"),
            "torch-imported": "torch" in sys.modules,
        }
        with open(argument, "w") as stream:
            json.dump(seen, stream)
    elif what == "raise":
        raise RuntimeError("a ClientApp that raises")
    elif what == "exit":
        os._exit(int(argument))
    elif what == "hang":
        time.sleep(3600)
    else:
        raise ValueError(f"unknown instruction {spec['token']!r}")
