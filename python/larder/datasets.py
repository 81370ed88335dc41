"""`larder.datasets` is `larder.torch.datasets` by a shorter name: torchvision.datasets for a
script ported to larder (see there). Its names are that module's, every other one torchvision's."""

from larder.torch import datasets as _torch_datasets
from larder.torch.datasets import ImageFolder, Recipe, class_names, recipe

__all__ = ["ImageFolder", "Recipe", "recipe", "class_names"]


def __getattr__(name: str):
    """FakeData, CIFAR10, ...: torchvision's own, as `larder.torch.datasets` gives them."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_torch_datasets, name)
