"""A training script in the shape of timm's train.py (its argument names and defaults, its
create_dataset / create_loader calls, FastCollateMixup under the prefetcher, per-batch all-reduce
in validation), ported to larder by one added line, marked "larder" below.

    python timm_port.py --data-dir DIR --model resnet18 --num-classes 1000   (DIR/train, DIR/validation or val)
    torchrun --nproc_per_node 2 timm_port.py --data-dir DIR ...

The loaders' arguments are timm's: the random-resized crop, flip and interpolation become the
daemon's train pipeline, colour jitter (0.4 by default) and random erasing run on the device,
mixup after timm's own PrefetchLoader; see larder/timm.py.
"""

import argparse
import os

import torch
import torch.distributed as dist
from timm.data import create_dataset, create_loader, resolve_data_config, Mixup, FastCollateMixup
from larder.timm import create_dataset, create_loader  # larder  # noqa: F811
from timm.loss import SoftTargetCrossEntropy, LabelSmoothingCrossEntropy
from timm.models import create_model
from timm.optim import create_optimizer_v2


def reduce_tensor(tensor, n):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / n


def _set_loader_epoch(loader, epoch: int) -> None:
    """As train.py sets each epoch on its loader."""
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, "set_epoch"):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)


def main() -> None:
    p = argparse.ArgumentParser(description="timm train.py's shape, fed by larder")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dataset", default="")
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="validation")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--num-classes", type=int, default=None)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--crop-pct", type=float, default=None)
    p.add_argument("-b", "--batch-size", type=int, default=128)
    p.add_argument("-vb", "--validation-batch-size", type=int, default=None)
    p.add_argument("-j", "--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--opt", default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--scale", type=float, nargs="+", default=[0.08, 1.0])
    p.add_argument("--ratio", type=float, nargs="+", default=[3.0 / 4.0, 4.0 / 3.0])
    p.add_argument("--hflip", type=float, default=0.5)
    p.add_argument("--vflip", type=float, default=0.0)
    p.add_argument("--color-jitter", type=float, default=0.4)
    p.add_argument("--aa", default=None)
    p.add_argument("--reprob", type=float, default=0.0)
    p.add_argument("--remode", default="pixel")
    p.add_argument("--recount", type=int, default=1)
    p.add_argument("--mixup", type=float, default=0.0)
    p.add_argument("--cutmix", type=float, default=0.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--train-interpolation", default="random")
    p.add_argument("--no-prefetcher", action="store_true", default=False)
    p.add_argument("--pin-mem", action="store_true", default=False)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    args.prefetcher = not args.no_prefetcher

    args.distributed = "RANK" in os.environ
    if args.distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    args.world_size = dist.get_world_size() if args.distributed else 1
    args.rank = dist.get_rank() if args.distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed + args.rank)

    model = create_model(args.model, num_classes=args.num_classes)
    data_config = resolve_data_config(vars(args), model=model)
    model.to(device)
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = create_optimizer_v2(model, args.opt, lr=args.lr)

    dataset_train = create_dataset(args.dataset, root=args.data_dir, split=args.train_split, is_training=True,
                                   batch_size=args.batch_size, seed=args.seed)
    dataset_eval = create_dataset(args.dataset, root=args.data_dir, split=args.val_split, is_training=False,
                                  batch_size=args.batch_size)

    collate_fn = None
    mixup_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0.0
    if mixup_active:
        mixup_args = dict(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                          num_classes=args.num_classes)
        if args.prefetcher:
            collate_fn = FastCollateMixup(**mixup_args)
        else:
            mixup_fn = Mixup(**mixup_args)

    train_interpolation = args.train_interpolation or data_config["interpolation"]
    common_loader_kwargs = dict(
        mean=data_config["mean"],
        std=data_config["std"],
        pin_memory=args.pin_mem,
        img_dtype=torch.float32,
        device=device,
        distributed=args.distributed,
        use_prefetcher=args.prefetcher,
    )
    train_loader_kwargs = dict(
        batch_size=args.batch_size,
        is_training=True,
        no_aug=False,
        re_prob=args.reprob,
        re_mode=args.remode,
        re_count=args.recount,
        re_split=False,
        train_crop_mode=None,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        color_jitter_prob=None,
        grayscale_prob=0.0,
        gaussian_blur_prob=0.0,
        auto_augment=args.aa,
        num_aug_repeats=0,
        num_aug_splits=0,
        interpolation=train_interpolation,
        num_workers=args.workers,
        worker_seeding="all",
    )
    loader_train = create_loader(
        dataset_train,
        input_size=data_config["input_size"],
        input_size_choices=None,
        batch_size_choices=None,
        batch_choice_weights=None,
        batch_choice_seed=args.seed,
        batch_choice_schedule="constant",
        batch_schedule_epochs=None,
        batch_schedule_spread=0.65,
        batch_schedule_random_mix=0.1,
        num_batches=None,
        collate_fn=collate_fn,
        use_multi_epochs_loader=False,
        **common_loader_kwargs,
        **train_loader_kwargs,
    )
    eval_loader_kwargs = dict(
        batch_size=args.validation_batch_size or args.batch_size,
        is_training=False,
        interpolation=data_config["interpolation"],
        num_workers=args.workers,
        crop_pct=data_config["crop_pct"],
    )
    loader_eval = create_loader(
        dataset_eval,
        input_size=data_config["input_size"],
        **common_loader_kwargs,
        **eval_loader_kwargs,
    )

    if mixup_active:
        train_loss_fn = SoftTargetCrossEntropy()
    elif args.smoothing:
        train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        train_loss_fn = torch.nn.CrossEntropyLoss()
    validate_loss_fn = torch.nn.CrossEntropyLoss().to(device)

    for epoch in range(args.epochs):
        _set_loader_epoch(loader_train, epoch)
        model.train()
        seen, losses, shapes = 0, [], set()
        for input, target in loader_train:
            if not args.prefetcher:
                input, target = input.to(device), target.to(device)
                if mixup_fn is not None:
                    input, target = mixup_fn(input, target)
            loss = train_loss_fn(model(input), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += input.shape[0]
            losses.append(loss.item())
            shapes.add((tuple(input.shape[1:]), str(input.dtype), tuple(target.shape[1:])))
        print(f"rank {args.rank} epoch {epoch}: train loss {sum(losses) / max(len(losses), 1):.4f} "
              f"({seen} samples, {len(losses)} batches of {len(loader_train)}; {sorted(shapes)})", flush=True)

        # timm's validate: top-1 per batch, all-reduced per batch under DDP.
        model.eval()
        top1_sum, top1_count, batches = 0.0, 0, 0
        with torch.no_grad():
            for input, target in loader_eval:
                if not args.prefetcher:
                    input, target = input.to(device), target.to(device)
                output = model(input)
                validate_loss_fn(output, target)
                acc1 = (output.argmax(1) == target).float().mean() * 100
                if args.distributed:
                    acc1 = reduce_tensor(acc1, args.world_size)
                top1_sum += acc1.item() * output.size(0)
                top1_count += output.size(0)
                batches += 1
        print(f"rank {args.rank} epoch {epoch}: val top-1 {top1_sum / max(top1_count, 1):.3f} over "
              f"{top1_count} samples in {batches} batches", flush=True)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
