"""Python client for larderd: preprocessed training batches over gRPC.

`Client` streams batches of named, typed fields as numpy arrays (and torch tensors); `larder.torch` has a
`torch.utils.data.IterableDataset` for DataLoader workers and DDP ranks.
"""

from larder.client import Batch, Client, InputStats, LarderError, Ragged, DEFAULT_ADDRESS

__all__ = ["Batch", "Client", "InputStats", "LarderError", "Ragged", "DEFAULT_ADDRESS"]
__version__ = "0.1.0"
