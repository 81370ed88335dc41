"""Trains and validates an image classifier on image folders served by larderd, in the shape of
pytorch/examples' ImageNet script (argparse, train and validate loops, top-1/top-5 meters, DDP
under torchrun), ported to larder the way that script is ported: three changed lines, marked
"larder" below.

    python examples/imagenet_train.py DIR [--arch resnet18]          (DIR/train, DIR/val)
    torchrun --nproc_per_node 2 examples/imagenet_train.py DIR

The script's own torchvision transforms stay as they are: `larder.torch.datasets.ImageFolder`
reads them (RandomResizedCrop + RandomHorizontalFlip: the daemon's train pipeline; Resize +
CenterCrop: its eval one; ToTensor and Normalize: done on the batch, on the GPU when there is
one), and `larder.torch.DataLoader` takes the script's DataLoader arguments as they were
(workers, shuffle, its DistributedSamplers, pin_memory: larder says once in the log what it
leaves aside, and follows the samplers' `set_epoch`). Validation is exact under any number of
ranks with the script's own loop (its meters, all-reduced at the end, and its check for a tail
its sampler left out): the val stream serves every image exactly once; ranks may get one batch
more or less, which a loop that all-reduces only at the end does not mind. (A loop that
all-reduces every batch, as timm's, needs equal batch counts: `valid=True` and
`exact_counts`; see timm_train.py.)
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as transforms

from larder.torch import datasets, DataLoader  # larder (was: import torchvision.datasets as datasets)


def small_cnn(channels: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4, classes),
    )


class Meter:
    """A running average, as the meters of such scripts keep."""

    def __init__(self, name: str):
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, value: float, n: int = 1) -> None:
        self.sum += value * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)


def correct_at(output: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B]: whether the target is among the k best guesses."""
    k = min(k, output.shape[1])
    return (output.topk(k, 1).indices == target[:, None]).any(1)


def train(loader, model, criterion, optimizer, epoch, device, rank) -> None:
    model.train()
    loss_m, top1 = Meter("Loss"), Meter("Acc@1")
    started = time.perf_counter()
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_m.update(loss.item(), len(target))
        top1.update(correct_at(output, target, 1).float().mean().item() * 100, len(target))
    secs = time.perf_counter() - started
    print(f"rank {rank} epoch {epoch}: train Loss {loss_m.avg:.4f} Acc@1 {top1.avg:.3f} "
          f"({loss_m.count} samples, {loss_m.count / secs:.0f}/s)", flush=True)


def validate(loader, model, device, distributed: bool) -> tuple:
    """(top-1 %, top-5 %, images counted), over every rank: the meters of each rank's batches,
    all-reduced at the end, as pytorch/examples' main.py does."""
    model.eval()
    top1, top5 = Meter("Acc@1"), Meter("Acc@5")
    with torch.no_grad():
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            output = model(images)
            target = target.to(output.device)
            top1.update(100.0 * correct_at(output, target, 1).float().mean().item(), images.size(0))
            top5.update(100.0 * correct_at(output, target, 5).float().mean().item(), images.size(0))
    if distributed:
        for m in (top1, top5):
            t = torch.tensor([m.sum, m.count], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            m.sum, m.count = t[0].item(), int(t[1].item())
        # main.py evaluates here, on every rank, the tail its DistributedSampler(drop_last=True)
        # left out; larder served every image, so there is none.
        world = dist.get_world_size()
        assert len(loader.sampler) * world >= len(loader.dataset), "main.py would run its tail loader"
    return top1.avg, top5.avg, top1.count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a folder with train/ and val/ image folders (class subfolders)")
    p.add_argument("--address", default=None, help="larderd address (default: $LARDER_ADDR)")
    p.add_argument("--arch", default="small", help="'small', or a torchvision.models name")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("-b", "--batch-size", type=int, default=256)
    p.add_argument("-j", "--workers", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.address:
        os.environ["LARDER_ADDR"] = args.address

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    if args.arch == "small":
        model = small_cnn(3, args.classes)
    else:
        import torchvision

        model = torchvision.models.__dict__[args.arch](num_classes=args.classes)
    model = model.to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9)

    # Data loading, as the script has it.
    traindir = os.path.join(args.data, "train")
    valdir = os.path.join(args.data, "val")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(
        traindir,
        transforms.Compose([
            transforms.RandomResizedCrop(args.crop),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]))
    val_dataset = datasets.ImageFolder(
        valdir,
        transforms.Compose([
            transforms.Resize(args.resize),
            transforms.CenterCrop(args.crop),
            transforms.ToTensor(),
            normalize,
        ]))
    if distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = None
        val_sampler = None

    train_loader = DataLoader(  # larder (was: torch.utils.data.DataLoader()
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=True, sampler=train_sampler)

    val_loader = DataLoader(  # larder (was: torch.utils.data.DataLoader()
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    for epoch in range(args.epochs):
        if distributed:
            train_sampler.set_epoch(epoch)  # as such scripts do: the larder dataset follows
        train(train_loader, model, criterion, optimizer, epoch, device, rank)
        # larder: was the epoch input-bound? (the loop's own wait for batches, and the daemon's
        # cause and fix when it was)
        print(f"rank {rank} epoch {epoch}: {train_loader.dataset.input_stats()}", flush=True)
        acc1, acc5, counted = validate(val_loader, model, device, distributed)
        if rank == 0:
            print(f"epoch {epoch}: val Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} over {counted} images "
                  f"(the dataset has {len(val_loader.dataset)})", flush=True)
    if distributed:
        dist.barrier()  # every rank done with its collectives before the group goes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
