"""A job over several nodes, a larderd each: N daemons on this machine as N nodes (their own
sockets, memory tiers and budgets), one rank each. With `nodes`, each node reads its own part
of every epoch, so its cache keeps serving it; without, each rank reads a different quarter of
the dataset each epoch and a node's cache serves about its share of the dataset."""

import numpy as np

import larder
from conftest import Daemon

N = 2000
NODES = 4


def make_h5(path):
    import h5py

    with h5py.File(path, "w") as f:
        # Chunks of 10 rows: granules of 10 samples, 200 of them dealt to the partitions (a
        # dataset of few, large granules splits unevenly between nodes).
        f.create_dataset("images", data=np.random.default_rng(0).integers(0, 256, (N, 3, 32, 32), dtype=np.uint8),
                         chunks=(10, 3, 32, 32))
        f.create_dataset("labels", data=np.arange(N, dtype=np.int64))


def run_job(daemons, epochs, **split):
    """Each epoch's memory hit rate on each node, and its raw reads over all nodes (samples);
    checks every sample comes once an epoch over the nodes' ranks."""
    clients = [larder.Client(d.unix) for d in daemons]
    rates, raw = [], []
    try:
        for epoch in range(epochs):
            before = [{t.tier: t.hits for t in c.stats().tiers} for c in clients]
            seen = []
            for rank, c in enumerate(clients):
                node = {"nodes": NODES, "node": rank} if split else {}
                for b in c.stream("d", 50, seed=3, epoch=epoch, rank=rank, world_size=NODES, transport="bytes",
                                  **node, **split):
                    ids = b.sample_ids[: len(b.sample_ids) - b.padding]
                    seen.extend(int(i) for i in ids)
            # Every sample, each once: counted, not a set (a sample served twice fails).
            assert sorted(seen) == list(range(N)), f"epoch {epoch}: not every sample exactly once"
            after = [{t.tier: t.hits for t in c.stats().tiers} for c in clients]
            hits = [a["memory"] - b0["memory"] for a, b0 in zip(after, before)]
            looked = [sum(a.values()) - sum(b0.values()) for a, b0 in zip(after, before)]
            rates.append([h / max(1, n) for h, n in zip(hits, looked)])
            raw.append(sum(a["raw"] - b0["raw"] for a, b0 in zip(after, before)))
    finally:
        for c in clients:
            c.close()
    return rates, raw


def test_each_node_keeps_its_part_of_the_dataset_hot(tmp_path):
    make_h5(tmp_path / "d.h5")
    # Each daemon's tier holds about 30% of the dataset's samples (3x32x32 records of 3,088
    # bytes in slabs, 192 of bookkeeping; the message path takes a quarter of the budget).
    budget = int(0.30 * N * (3088 + 192) / 0.75)
    daemons = []
    try:
        for k in range(NODES):
            (tmp_path / f"n{k}").mkdir()
            daemons.append(Daemon(tmp_path / f"n{k}", f'[[dataset]]\nname = "d"\npath = "{tmp_path / "d.h5"}"\nlabels = "labels"\n',
                                  scratch="enabled = false\n", budget_bytes=budget))
        split_rates, split_raw = run_job(daemons, 4, partitions=8)
        for d in daemons:  # a cold start for the comparison
            d.stop()
            d.start()
        global_rates, global_raw = run_job(daemons, 4)
        for d in daemons:
            d.stop()
            d.start()
        swap_rates, swap_raw = run_job(daemons, 4, partitions=8, swap=0.1)
    finally:
        for d in daemons:
            d.stop()
    print("node-aware:", [[round(r, 3) for r in e] for e in split_rates], split_raw)
    print("global order:", [[round(r, 3) for r in e] for e in global_rates], global_raw)
    print("node-aware, swap 10%:", [[round(r, 3) for r in e] for e in swap_rates], swap_raw)
    for epoch in range(1, 4):
        assert min(split_rates[epoch]) >= 0.95, (epoch, split_rates[epoch])
        assert split_raw[epoch] <= 0.05 * N, (epoch, split_raw[epoch])
        assert max(global_rates[epoch]) < 0.5, (epoch, global_rates[epoch])
        # A tenth of the granules change partition each epoch: about a tenth of each node's
        # part is read anew (raw reads within Q + 0.05 of the dataset).
        assert 0.75 <= min(swap_rates[epoch]) and max(swap_rates[epoch]) < 1.0, (epoch, swap_rates[epoch])
        assert swap_raw[epoch] <= (0.1 + 0.05) * N, (epoch, swap_raw[epoch])


def test_the_torch_dataset_reads_its_nodes_part(tmp_path):
    """LarderIterableDataset with nodes=2 on 2 nodes of 2 ranks: every sample once an epoch
    (padding masked out), and each node's samples the same every epoch."""
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    from larder.torch import LarderIterableDataset

    make_h5(tmp_path / "d.h5")
    daemons = []
    try:
        for k in range(2):
            (tmp_path / f"n{k}").mkdir()
            daemons.append(Daemon(tmp_path / f"n{k}", f'[[dataset]]\nname = "d"\npath = "{tmp_path / "d.h5"}"\nlabels = "labels"\n'))
        parts = {}
        for epoch in range(2):
            seen = []
            for rank in range(4):
                node = rank // 2
                ds = LarderIterableDataset("d", 64, address=daemons[node].unix, seed=1, epoch=epoch, rank=rank,
                                           world_size=4, nodes=2, valid=True)
                ids = []
                for _, labels, valid in ds:
                    ids.extend(int(i) for i in labels[valid])
                seen.extend(ids)
                parts.setdefault((epoch, node), set()).update(ids)
            assert sorted(seen) == list(range(N)), f"epoch {epoch}"
        for node in range(2):
            assert parts[(0, node)] == parts[(1, node)], "a node's part is the same every epoch"
        assert not parts[(0, 0)] & parts[(0, 1)]
    finally:
        for d in daemons:
            d.stop()


def test_a_job_resumed_on_fewer_nodes_reads_the_rest_of_the_epoch_once(tmp_path):
    """A job of 4 nodes (2 ranks each) checkpoints after 3 steps and resumes on 2 nodes (then
    on the same 2 again, mid-epoch): every sample of the epoch once over the three runs, through
    LarderIterableDataset's state_dict / load_state_dict (one daemon serves every node here:
    the node is a request's, the cache a daemon's)."""
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    from larder.torch import LarderIterableDataset

    make_h5(tmp_path / "d.h5")
    d = Daemon(tmp_path, f'[[dataset]]\nname = "d"\npath = "{tmp_path / "d.h5"}"\nlabels = "labels"\n')
    try:
        def run(nodes, state, steps):
            """Each rank of `nodes` nodes of 2 ranks from `state`, `steps` steps (None: to the
            epoch's end); the samples served and the state every rank agrees on."""
            seen, states = [], []
            for rank in range(2 * nodes):
                ds = LarderIterableDataset("d", 50, address=d.unix, seed=5, rank=rank, world_size=2 * nodes,
                                           nodes=nodes, partitions=8, valid=True)
                if state is not None:
                    ds.load_state_dict(state)
                for k, (_, labels, valid) in enumerate(ds):
                    seen.extend(int(i) for i in labels[valid])
                    if steps is not None and k + 1 == steps:
                        break
                states.append(ds.state_dict())
            assert all(s == states[0] for s in states), states
            return seen, states[0]

        seen, state = run(4, None, 3)
        assert state["nodes"] == 4 and state["sample"] == 3 * 2 * 50, state
        more, state = run(2, state, 2)
        assert state["resumed"] == [4, 300] and state["sample"] == 2 * 2 * 50, state
        rest, end = run(2, state, None)
        seen = sorted(seen + more + rest)
        assert seen == list(range(N)), "every sample of the epoch once"
        assert end["epoch"] == 1 and end["sample"] == 0, end
        with pytest.raises(ValueError, match="once"):
            run(1, state, 1)  # a second change of nodes within the epoch
    finally:
        d.stop()


def test_each_node_reads_its_next_epoch_ahead_into_the_scratch_tier(tmp_path):
    """With `swap`, a share of a node's part is new each epoch. Each daemon reads its node's
    next part into its scratch tier while the current epoch streams, so from the second epoch
    on nothing is served from raw storage; what it reads ahead over all nodes is about the
    swapped share of the dataset."""
    import time

    make_h5(tmp_path / "d.h5")
    nodes, swap = 2, 0.25
    daemons = []
    try:
        for k in range(nodes):
            (tmp_path / f"n{k}").mkdir()
            daemons.append(Daemon(tmp_path / f"n{k}", f'[[dataset]]\nname = "d"\npath = "{tmp_path / "d.h5"}"\nlabels = "labels"\n',
                                  budget_bytes=2_000_000))
        clients = [larder.Client(d.unix) for d in daemons]

        def settled():
            """Each daemon's read-ahead counters, once they stop moving."""
            last = None
            for _ in range(100):
                now = [(s.prefetched_samples, s.prefetched_raw_bytes) for s in (c.stats() for c in clients)]
                if now == last:
                    return now
                last = now
                time.sleep(0.3)
            raise AssertionError(f"read-ahead still moving: {now}")

        raw_served, ahead = [], []
        for epoch in range(4):
            before = [{t.tier: t.hits for t in c.stats().tiers} for c in clients]
            ahead_before = settled()
            seen = []
            for node, c in enumerate(clients):
                for b in c.stream("d", 50, seed=3, epoch=epoch, rank=node, world_size=nodes, nodes=nodes, node=node,
                                  partitions=8, swap=swap, transport="bytes"):
                    seen.extend(int(i) for i in b.sample_ids[: len(b.sample_ids) - b.padding])
            assert sorted(seen) == list(range(N)), f"epoch {epoch}: every sample once"
            after = [{t.tier: t.hits for t in c.stats().tiers} for c in clients]
            raw_served.append([a["raw"] - b0["raw"] for a, b0 in zip(after, before)])
            now = settled()
            ahead.append([(n[0] - b0[0], n[1] - b0[1]) for n, b0 in zip(now, ahead_before)])
        for c in clients:
            c.close()
    finally:
        for d in daemons:
            d.stop()
    print("served from raw storage per epoch and node:", raw_served)
    print("read ahead per epoch and node (samples, raw bytes):", ahead)
    # The first epoch is cold: each granule (an HDF5 chunk of 10 rows) read from raw storage
    # once, its other samples then served from the scratch tier.
    assert sum(raw_served[0]) == N // 10, raw_served[0]
    for epoch in range(1, 4):
        assert raw_served[epoch] == [0] * nodes, f"epoch {epoch}: served from raw storage {raw_served[epoch]}"
    record = 3 * 32 * 32
    for epoch in range(3):  # epoch e's streams read epoch e + 1's new granules ahead
        samples = sum(s for s, _ in ahead[epoch])
        raw = sum(b for _, b in ahead[epoch])
        assert 0 < samples <= (swap + 0.05) * N, (epoch, ahead[epoch])
        assert raw <= (swap + 0.05) * N * record, (epoch, ahead[epoch])
