"""Train the MoE transformer: a launcher for :mod:`moe.train` (the configuration, the Trainer, the loop).

    python examples/train.py                                   # one process: the byte-level demo
    torchrun --standalone --nproc-per-node 4 examples/train.py --pp 2 --ep 2 --steps 80
    torchrun ... examples/train.py --config examples/configs/tiny.toml --print-config

``--help`` lists every option; each is a field of a table of the TOML file.
"""

import os
import sys

# Run as a script (``python examples/train.py``), the repository root is not on the path unless installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe.train import cli

if __name__ == "__main__":
    cli()
