"""Python client for larderd: preprocessed training batches over gRPC.

`Client` streams batches of named, typed fields as numpy arrays (and torch tensors); `larder.torch` has a
`torch.utils.data.IterableDataset` for DataLoader workers and DDP ranks.
"""

from larder.addresses import DEFAULT_ADDRESS
from larder.batch import Batch, Ragged
from larder.client import Client
from larder.errors import LarderError
from larder.inputstats import InputStats

__all__ = ["Batch", "Client", "InputStats", "LarderError", "Ragged", "DEFAULT_ADDRESS"]
from larder.version import CLIENT_VERSION as __version__  # noqa: E402
