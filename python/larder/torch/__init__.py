"""torch integration: an IterableDataset for DataLoader workers and DDP ranks, the DataLoaders
scripts use, the ports of torchvision's ImageFolder, and the uint8 to float conversion that
belongs on the GPU.

    dataset.py      LarderIterableDataset
    loaders.py      loader(ds, ...) and DataLoader(dataset, ...), in the shape scripts use
    folder.py       ImageFolder(path, batch_size, ...): a folder named by path, its recipe as arguments
    datasets.py     torchvision.datasets for a ported script (also `larder.datasets`)
    tensors.py      to_float, exact_counts
    epochs.py       the epoch clock workers share, and the state a checkpoint keeps
    connections.py  one daemon connection per process
    roles.py        where Accelerate iterates a dataset
    notes.py        what is said once in the log
"""

from larder.client import Client
from larder.torch import datasets
from larder.torch.dataset import LarderIterableDataset
from larder.torch.folder import ImageFolder
from larder.torch.loaders import DataLoader, EpochSampler, Loader, loader
from larder.torch.tensors import exact_counts, to_float

__all__ = ["LarderIterableDataset", "loader", "Loader", "EpochSampler", "DataLoader", "ImageFolder", "datasets",
           "to_float", "exact_counts", "Client"]
