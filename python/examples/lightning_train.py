"""Trains a small CNN with PyTorch Lightning on a dataset served by larderd.

    python examples/lightning_train.py --address unix:/run/larder/larder.sock --dataset cifar10-train
    python examples/lightning_train.py ... --devices 2       # DDP, one process per device

Every epoch comes in a new order (iterating the dataset again is the next epoch), every DDP
rank gets the same number of batches, and a checkpoint taken mid-epoch resumes with exactly the
samples not yet seen (--resume).
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader

import larder
from larder.torch import LarderIterableDataset, to_float


class Classifier(L.LightningModule):
    def __init__(self, channels: int, classes: int, lr: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4, classes),
        )
        self.lr = lr
        self.seen = self.correct = 0

    def training_step(self, batch, batch_idx):
        images, labels = batch  # uint8 images: converted to float here, on the device
        logits = self.net(to_float(images, self.device))
        self.seen += len(labels)
        self.correct += int((logits.argmax(1) == labels).sum())
        return nn.functional.cross_entropy(logits, labels)

    def on_train_epoch_end(self):
        print(f"epoch {self.current_epoch} rank {self.global_rank}: accuracy "
              f"{self.correct / max(self.seen, 1):.3f} ({self.seen} samples)", flush=True)
        self.seen = self.correct = 0

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class LarderData(L.LightningDataModule):
    def __init__(self, address: str, dataset: str, batch_size: int):
        super().__init__()
        # Built before Lightning starts DDP: ranks are resolved when iteration starts.
        self.ds = LarderIterableDataset(dataset, batch_size, address=address)

    def train_dataloader(self):
        # batch_size=None: the daemon batches. num_workers=0 is fastest (batches arrive in
        # shared memory, read ahead by a thread); a StatefulDataLoader is what lets Lightning
        # save and restore the position mid-epoch.
        return StatefulDataLoader(self.ds, batch_size=None, num_workers=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="larderd address (default: $LARDER_ADDR)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--resume", default=None, help="a checkpoint to resume from")
    args = p.parse_args()

    with larder.Client(args.address) as client:
        channels = next(f for f in client.dataset(args.dataset).fields if f.name == "image").shape[0]
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=args.epochs, devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto",
                        logger=False, enable_progress_bar=False)
    trainer.fit(Classifier(channels, args.classes, args.lr),
                LarderData(args.address, args.dataset, args.batch_size), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
