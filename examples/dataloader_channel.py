# SPDX-License-Identifier: Apache-2.0
"""A torch DataLoader whose workers hand batches to the main process over dlpackd channels.

torch's DataLoader with num_workers > 0 collates each batch in a worker process and sends it to
the main process through a multiprocessing queue: the tensors are moved into shared memory,
pickled with their file descriptors, and rebuilt on the other side. Here each worker sends its
collated batch as one channel message instead (a bundle of the batch's tensors), and the main
process receives it zero-copy. As in DataLoader, batch i is made by worker i % num_workers and
batches come out in order: each worker has a channel of its own and the main process receives
from them in turn.

    python3 examples/dataloader_channel.py [--batches N] [--workers W] [--batch-size B]
                                           [--shape C,H,W] [--direct] [--check]

--direct uses direct channels: each batch goes from worker to main process through a socket
pair dlpackd hands out, never through the daemon. --check also runs torch's own DataLoader over
the same dataset and compares every batch.
Needs a running dlpackd ($DLPACKD_SOCKET, or the default socket).
"""
import argparse
import os
import sys

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, default_collate

import dlpack_ipc


class Synthetic(Dataset):
    """Deterministic samples: an image-like float tensor and an int label."""

    def __init__(self, n, shape):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.rand(self.shape, generator=g), i % 10


def _worker(dataset, batches, worker, nworkers, channel, capacity, direct, collate):
    """Collate the batches this worker owns (i % nworkers == worker) and send each in order."""
    torch.set_num_threads(1)
    ch = dlpack_ipc.channel(channel, capacity, direct=direct)
    for i in range(worker, len(batches), nworkers):
        data, labels = collate([dataset[j] for j in batches[i]])
        ch.send_dict({"data": data, "labels": labels})


class ChannelLoader:
    """Iterate a dataset's batches as DataLoader(dataset, batch_size, num_workers) does, with
    dlpackd channels for the worker-to-main transfer. Each batch is (data, labels); the tensors
    are the workers' memory, received without a copy (read-only: copy before writing)."""

    def __init__(self, dataset, batch_size, num_workers=2, prefetch=2, collate=default_collate,
                 direct=False):
        self.dataset, self.batch_size = dataset, batch_size
        self.num_workers, self.prefetch, self.collate = num_workers, prefetch, collate
        self.direct = direct

    def __len__(self):
        return (len(self.dataset) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        n = len(self.dataset)
        batches = [list(range(s, min(s + self.batch_size, n))) for s in range(0, n, self.batch_size)]
        tag = f"examples/loader/{os.getpid()}/{id(self)}"
        names = [f"{tag}/w{k}" for k in range(self.num_workers)]
        channels = [dlpack_ipc.channel(name, self.prefetch, direct=self.direct)
                    for name in names]
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_worker,
                             args=(self.dataset, batches, k, self.num_workers, names[k],
                                   self.prefetch, self.direct, self.collate), daemon=True)
                 for k in range(self.num_workers)]
        for p in procs:
            p.start()
        try:
            for i in range(len(batches)):
                msg = channels[i % self.num_workers].recv(timeout=60)
                yield torch.from_dlpack(msg["data"]), torch.from_dlpack(msg["labels"])
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise RuntimeError(f"worker {p.pid} exited with {p.exitcode}")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            for ch in channels:
                ch.remove()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shape", default="3,32,32")
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    shape = tuple(int(s) for s in a.shape.split(","))
    ds = Synthetic(a.batches * a.batch_size, shape)
    got = list(ChannelLoader(ds, a.batch_size, a.workers, direct=a.direct))
    print(f"{len(got)} batches of {tuple(got[0][0].shape)} over dlpackd "
          f"{'direct ' if a.direct else ''}channels from {a.workers} workers")
    if a.check:
        ref = DataLoader(ds, batch_size=a.batch_size, num_workers=a.workers)
        for i, ((x, y), (rx, ry)) in enumerate(zip(got, ref)):
            if not (torch.equal(x, rx) and torch.equal(y, ry)):
                print(f"batch {i} differs from DataLoader's", file=sys.stderr)
                return 1
        print("every batch equals torch DataLoader's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
