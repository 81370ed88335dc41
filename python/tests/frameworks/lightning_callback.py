"""larder.lightning.InputStats() under a Lightning fit of 2 epochs over larder.torch.loader:
writes what the callback found at the last epoch's end, the log lines it wrote, and the
trainer's metrics, for the test to check.

    python lightning_callback.py ADDRESS OUT

The tests run it with others in one process (runs.py), calling main(args).
"""

import argparse
import json
import logging
import pathlib

import lightning as L
import torch

import larder.lightning
import larder.torch


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2 * 4 * 4, 10)

    def training_step(self, batch, _):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.net(images.float().flatten(1)), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("address")
    p.add_argument("out")
    a = p.parse_args(argv)
    ds = larder.torch.LarderIterableDataset("train", 16, address=a.address, seed=1)
    callback = larder.lightning.InputStats()
    trainer = L.Trainer(max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    said, logger = Lines(), logging.getLogger("larder")
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        trainer.fit(Model(), larder.torch.loader(ds, batch_size=16))
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    found = {"last": [stats.as_dict() for stats in callback.last], "lines": said.lines,
             "metrics": sorted(trainer.callback_metrics)}
    (pathlib.Path(a.out) / "found.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
