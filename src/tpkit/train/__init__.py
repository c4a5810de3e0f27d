"""Training: data (embedded corpus), loop, optimizer, metrics (checkpoints: `tpkit.checkpoint`;
the `tpkit train` front-end: `tpkit.commands.train`).

    from tpkit.train import TrainConfig, train
    result = train(TrainConfig(preset="gpt2-tiny", tp=2, pp=2, steps=300), mesh)

`train` holds the run folder as the command does (`tpkit.train.run_policy`): `resume="auto"`
continues the newest checkpoint in `out`, a folder another run holds or wrote is refused
in one line. It is resolved on first use (`spec.lazy`): importing `tpkit.train` for its
config does not import the training loop.
"""

from tpkit.spec.lazy import lazy_names
from tpkit.train.config import TrainConfig

__all__ = ["TrainConfig", "train"]

__getattr__, __dir__ = lazy_names("tpkit.train", {"train": ("tpkit.train.loop", "train")},
                                  globals())
