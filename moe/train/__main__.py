"""``python -m moe.train`` (also ``torchrun ... -m moe.train``): see ``--help``."""

from moe.train.launch import cli

if __name__ == "__main__":
    cli()
