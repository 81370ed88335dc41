"""Lightning, as its docs show: a LightningModule and a plain DataLoader over the dataset in
train_dataloader(). Records the ids each rank trains on, per epoch.

    python lightning_fit.py ADDRESS OUT --devices N --workers K --epochs E
        [--stop-after S --ckpt-every C] [--resume CKPT] [--stateful]

The tests run it with others in one process (runs.py), calling main(args).
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Recorder, arguments, loss, model  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, record, stop_after=None):
        super().__init__()
        self.net = model()
        self.record, self.stop_after = record, stop_after

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.record(self.current_epoch, images, labels)
        if self.stop_after is not None and self.global_step + 1 >= self.stop_after:
            self.trainer.should_stop = True
        return loss(self.net, images, labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    def __init__(self, address, workers, stateful):
        super().__init__()
        self.address, self.workers, self.stateful = address, workers, stateful
        # Built before the trainer starts DDP: the rank is resolved when iteration starts.
        self.ds = LarderIterableDataset("train", 10, address=address, seed=3)

    def train_dataloader(self):
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(self.ds, batch_size=None, num_workers=self.workers)
        return DataLoader(self.ds, batch_size=None, num_workers=self.workers)


def main(argv=None):
    p = arguments(__doc__)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--ckpt-every", type=int)
    p.add_argument("--resume")
    p.add_argument("--stateful", action="store_true")
    a = p.parse_args(argv)
    callbacks = []
    if a.ckpt_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=a.out, every_n_train_steps=a.ckpt_every, save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(
        max_epochs=a.epochs, accelerator="cpu", devices=a.devices,
        strategy="ddp" if a.devices > 1 else "auto", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(a.ckpt_every), callbacks=callbacks,
    )
    model = Model(None, a.stop_after)
    model.record = Recorder(a.out, trainer.global_rank)
    trainer.fit(model, Data(a.address, a.workers, a.stateful), ckpt_path=a.resume)


if __name__ == "__main__":
    main()
