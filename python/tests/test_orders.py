"""Order forms: form 2 (computed) is the default of this client, form 1 (listed) stays what clients
before forms get and what their checkpoints resume in; a checkpoint never resumes mid-epoch in
another form."""

import pytest

from larder import Client
from larder.v1 import larder_pb2 as pb

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from larder.torch import LarderIterableDataset  # noqa: E402
from test_torch import ids_of  # noqa: E402


def epoch(client, **shard):
    return [int(i) for b in client.stream("train", 8, **shard) for i in b.sample_ids]


def test_both_forms_serve_every_sample_once_in_different_orders(daemon):
    with Client(daemon.unix) as c:
        for form in (1, 2):
            got = []
            for rank in range(3):
                for worker in range(2):
                    got += epoch(c, seed=5, epoch=1, rank=rank, world_size=3, worker=worker, num_workers=2,
                                 order_version=form, even_batches=False)
            assert sorted(got) == list(range(300)), f"form {form}: every sample once"
        one, two = epoch(c, seed=5, order_version=1), epoch(c, seed=5, order_version=2)
        assert one != two and sorted(one) == sorted(two)
        assert epoch(c, seed=5, order_version=2) == two, "a pure function of (seed, epoch)"
        assert epoch(c, seed=5, epoch=1, order_version=2) != two
        assert [b.order_version for b in c.stream("train", 100, seed=5, order_version=1)] == [1] * 3
        assert [b.order_version for b in c.stream("train", 100, seed=5)] == [2] * 3
        # A request that names no form (a client before forms) gets form 1.
        legacy = pb.StreamBatchesRequest(dataset="train", batch_size=300, seed=5, layout_version=1)
        batch = next(iter(c._stub.StreamBatches(legacy)))
        assert list(batch.sample_ids) == one and batch.order_version == 1
        # A form this daemon does not know is refused, naming the forms it serves.
        unknown = pb.StreamBatchesRequest(dataset="train", batch_size=8, seed=5, layout_version=1, order_version=3)
        with pytest.raises(Exception, match="serves orders 1 and 2"):
            next(iter(c._stub.StreamBatches(unknown)))


def test_a_resumed_form_2_epoch_serves_exactly_the_rest(daemon):
    with Client(daemon.unix) as c:
        first = list(c.stream("train", 8, seed=3, world_size=2, rank=0))[:4]
        first += list(c.stream("train", 8, seed=3, world_size=2, rank=1))[:4]
        at = first[-1].resume_sample
        seen = [int(i) for b in first for i in b.sample_ids]
        rest = []
        for rank in range(3):
            rest += epoch(c, seed=3, world_size=3, rank=rank, start_sample=at, even_batches=False)
        assert sorted(seen + rest) == list(range(300))


def test_a_checkpoint_resumes_in_its_own_form_and_never_across_forms(daemon):
    ds = LarderIterableDataset("train", 8, address=daemon.unix, seed=9)
    it = iter(DataLoader(ds, batch_size=None))
    seen = ids_of([next(it) for _ in range(5)])
    state = ds.state_dict()
    del it
    assert state["order"] == 2 and state["sample"] == 40

    # A state from a client before forms (no "order") is of form 1: the rest is form 1's.
    old = LarderIterableDataset("train", 8, address=daemon.unix, seed=9, order_version=1)
    it = iter(DataLoader(old, batch_size=None))
    old_seen = ids_of([next(it) for _ in range(5)])
    old_state = {k: v for k, v in old.state_dict().items() if k != "order"}
    del it
    resumed = LarderIterableDataset("train", 8, address=daemon.unix, seed=9)
    resumed.load_state_dict(old_state)
    rest = ids_of(DataLoader(resumed, batch_size=None))
    assert sorted(old_seen + rest) == list(range(300)), "form 1's rest, every sample once"
    assert resumed.state_dict()["order"] == 1, "the run keeps the form it began in"

    # Asking for another form mid-epoch is refused with the way out.
    other = LarderIterableDataset("train", 8, address=daemon.unix, seed=9, order_version=1)
    with pytest.raises(ValueError, match="order_version=2"):
        other.load_state_dict(state)
    # At an epoch's end any form may follow.
    other.load_state_dict({**state, "sample": 0, "batches": 0, "epoch": 1})
    assert sorted(ids_of(DataLoader(other, batch_size=None))) == list(range(300))

    resumed = LarderIterableDataset("train", 8, address=daemon.unix, seed=9)
    resumed.load_state_dict(state)
    assert sorted(seen + ids_of(DataLoader(resumed, batch_size=None))) == list(range(300))


def test_correlated_orders_share_each_window_and_serve_each_job_every_sample_once(daemon):
    """Two jobs of one cohort with their own seeds: each every sample once, resumable; the
    same samples in every window of 60; different orders at nearly every position."""
    with Client(daemon.unix) as c:
        jobs = [epoch(c, seed=s, cohort_seed=11, window=60) for s in (1, 2)]
        for order in jobs:
            assert sorted(order) == list(range(300))
        for w in range(5):
            assert sorted(jobs[0][60 * w:60 * w + 60]) == sorted(jobs[1][60 * w:60 * w + 60])
        assert sum(a != b for a, b in zip(*jobs)) >= 0.95 * 300
        assert epoch(c, seed=1, cohort_seed=11, window=60) == jobs[0], "a pure function of its seeds"
        # Resumed on three ranks after 10 batches of 8: exactly the rest.
        rest = []
        for rank in range(3):
            rest += epoch(c, seed=1, cohort_seed=11, window=60, world_size=3, rank=rank, start_sample=80,
                          even_batches=False)
        assert sorted(jobs[0][:80] + rest) == list(range(300))
        with pytest.raises(ValueError, match="both its window"):
            epoch(c, seed=1, window=60)
        with pytest.raises(Exception, match="order form 2"):
            list(c._stub.StreamBatches(pb.StreamBatchesRequest(
                dataset="train", batch_size=8, layout_version=1, order_version=1, cohort_seed=1, window=60)))
