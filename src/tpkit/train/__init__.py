"""Training: data (embedded corpus), loop, optimizer, metrics (checkpoints: `tpkit.checkpoint`;
the `tpkit train` front-end: `tpkit.commands.train`).

    from tpkit.train.loop import train
    result = train(TrainConfig(preset="gpt2-tiny", tp=2, pp=2, steps=300), mesh)
"""

from tpkit.train.config import TrainConfig

__all__ = ["TrainConfig"]
