"""A timm recipe fed by larder: a timm model and optimizer, larder's uint8 batches through timm's
own prefetcher (`PrefetchLoader`, which moves them to the device and normalizes them there), mixup
and cutmix after it on the device (timm's `Mixup`: with larder the batches come collated, so
timm's collate-time `FastCollateMixup` has nothing to run in), label smoothing, and an exact
validation under DDP.

Run on one process, or under torchrun:

    python timm_train.py --address unix:/run/larder/larder.sock --train imagenet-train --val imagenet-val
    torchrun --nproc_per_node 2 timm_train.py ...

`--train`/`--val` name larder datasets; with `--folder` they are paths to image folders instead,
added for the calling user (`larder.torch.ImageFolder`) with the model's own eval recipe
(`crop_pct`, interpolation, from timm's `resolve_data_config`).
"""

import argparse
import os

import timm
import torch
import torch.distributed as dist
from timm.data import Mixup, resolve_data_config
from timm.data.loader import PrefetchLoader
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2

import larder.torch


def main() -> None:
    p = argparse.ArgumentParser(description="timm training fed by larder")
    p.add_argument("--address", default=None)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--folder", action="store_true", help="--train/--val are image folder paths")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("-b", "--batch-size", type=int, default=128)
    p.add_argument("-j", "--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--opt", default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-pipeline", default="train", help="'train' (random-resized crop and flip), or 'eval'")
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    model = timm.create_model(args.model, num_classes=args.classes, pretrained=False)
    config = resolve_data_config({"input_size": (3, args.img_size, args.img_size)} if args.img_size else {},
                                 model=model)
    model = model.to(device)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = create_optimizer_v2(model, args.opt, lr=args.lr)

    # larder: the datasets. timm drops the last partial train batch (and mixup needs an even
    # batch); validation keeps every image, its padding under DDP marked (valid=True).
    if args.folder:
        size = config["input_size"][-1]
        common = dict(address=args.address, crop=size, interpolation=config["interpolation"])
        train_ds = larder.torch.ImageFolder(args.train, args.batch_size, train=True, seed=args.seed,
                                            drop_last=True, **common)
        val_ds = larder.torch.ImageFolder(args.val, args.batch_size, train=False, crop_pct=config["crop_pct"],
                                          valid=True, normalize=(config["mean"], config["std"]), device=device,
                                          **common)
    else:
        train_ds = larder.torch.LarderIterableDataset(args.train, args.batch_size, address=args.address,
                                                      seed=args.seed, pipeline=args.train_pipeline, drop_last=True)
        val_ds = larder.torch.LarderIterableDataset(args.val, args.batch_size, address=args.address,
                                                    shuffle=False, valid=True,
                                                    normalize=(config["mean"], config["std"]), device=device)
    # larder: the loaders with timm's own arguments; then timm's prefetcher, unchanged.
    train_loader = larder.torch.loader(train_ds, batch_size=args.batch_size, num_workers=args.workers,
                                       pin_memory=True, drop_last=True)
    train_loader = PrefetchLoader(train_loader, mean=config["mean"], std=config["std"], device=device)
    val_loader = larder.torch.loader(val_ds, batch_size=args.batch_size, num_workers=args.workers)

    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                  num_classes=args.classes) if args.mixup or args.cutmix else None
    train_loss = SoftTargetCrossEntropy() if mixup else torch.nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        model.train()
        seen, total_loss, steps = 0, 0.0, 0
        for images, target in train_loader:
            if mixup is not None:
                images, target = mixup(images, target)
            loss = train_loss(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += images.shape[0]
            total_loss += loss.item()
            steps += 1
        print(f"rank {rank} epoch {epoch}: train loss {total_loss / max(steps, 1):.4f} ({seen} samples); "
              f"{train_ds.input_stats()}", flush=True)

        model.eval()
        correct = torch.zeros((), dtype=torch.long, device=device)
        counted = torch.zeros((), dtype=torch.long, device=device)
        with torch.no_grad():
            for images, target, valid in val_loader:
                hit = model(images).argmax(1) == target.to(device)
                correct += (hit & valid).sum()
                counted += valid.sum()
        # Every rank had as many batches (timm's per-batch all-reduce would work too); the
        # padding is counted out, so each val image counts once.
        if distributed:
            dist.all_reduce(correct)
            dist.all_reduce(counted)
        if rank == 0:
            print(f"epoch {epoch}: val top-1 {100.0 * correct.item() / max(counted.item(), 1):.3f} over "
                  f"{counted.item()} images (the dataset has {len(val_loader.dataset)})", flush=True)
    if distributed:
        dist.barrier()  # every rank done with its collectives before the group goes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
