# SPDX-License-Identifier: Apache-2.0
"""jax (CPU) as a consumer and a producer, across processes; venv stack only (tests/pystack.sh).

jax imports a DLPack tensor without a copy only where its data is aligned (and its dtype is one
jax uses: int64 becomes int32 unless x64 is enabled); dlpackd's tensors start 256-byte aligned.
jax runs in child interpreters only: it is multithreaded, and other tests of this session fork.
"""
import numpy as np


def test_jnp_from_dlpack_on_an_attached_tensor(ipc, py):
    ipc.publish("jax/x", np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    cp = py.check("""
        import gc, time
        import jax, jax.numpy as jnp, numpy as np, dlpack_ipc
        t = dlpack_ipc.attach("jax/x")
        ptr = t.data_ptr
        j = jnp.from_dlpack(t)
        k = jax.dlpack.from_dlpack(t)
        for a in (j, k):
            assert a.dtype == jnp.float32 and a.shape == (3, 4, 5), (a.dtype, a.shape)
            assert a.unsafe_buffer_pointer() == ptr, "a copy: the data was not aligned"
            assert (np.asarray(a) == np.arange(60).reshape(3, 4, 5)).all()
        # jax's arrays hold the mapping once the SharedTensor is gone...
        t.release()
        del t
        gc.collect()
        print(float((j * 2).sum()), dlpack_ipc.stat()["references"])
        # ...and give the daemon's reference back when they go
        del j, k, a
        gc.collect()
        deadline = time.monotonic() + 10
        while dlpack_ipc.stat()["references"] and time.monotonic() < deadline:
            time.sleep(0.02)
        print(dlpack_ipc.stat()["references"])
    """)
    assert cp.stdout.split() == [str(2.0 * sum(range(60))), "1", "0"]


def test_jax_takes_each_tensor_of_a_bundle(ipc, py):
    py.check("""
        import numpy as np, torch, dlpack_ipc
        dlpack_ipc.publish_dict("jax/sd", {
            "w": np.linspace(-1, 1, 21, dtype=np.float16).reshape(7, 3),
            "mask": torch.tensor([True, False, True, True]),
            "ids": np.arange(5, dtype=np.int32) * 11,
            "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
        })
    """)
    cp = py.check("""
        import jax.numpy as jnp, numpy as np, dlpack_ipc
        d = dlpack_ipc.attach_dict("jax/sd")
        got = {k: jnp.from_dlpack(v) for k, v in d.items()}
        for k, v in d.items():
            assert got[k].unsafe_buffer_pointer() == v.data_ptr, k
        assert (np.asarray(got["w"]) ==
                np.linspace(-1, 1, 21, dtype=np.float16).reshape(7, 3)).all()
        for k in sorted(got):
            print(k, got[k].dtype, np.asarray(got[k]).ravel().tolist()[:5])
    """)
    assert cp.stdout.splitlines() == [
        "ids int32 [0, 11, 22, 33, 44]",
        "mask bool [True, False, True, True]",
        "u8 uint8 [0, 1, 2, 3, 4]",
        f"w float16 {np.linspace(-1, 1, 21, dtype=np.float16).tolist()[:5]}",
    ]


def test_a_jax_array_published_and_attached_by_jax_in_another_process(ipc, py):
    py.check("""
        import jax.numpy as jnp, dlpack_ipc
        dlpack_ipc.publish("jax/made", jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 0.5)
    """)
    cp = py.check("""
        import jax.numpy as jnp, dlpack_ipc
        t = dlpack_ipc.attach("jax/made")
        a = jnp.from_dlpack(t)
        assert a.unsafe_buffer_pointer() == t.data_ptr
        print(a.dtype, a.shape, float(a.sum()), float(a[2, 3]))
    """)
    assert cp.stdout.split() == ["float32", "(3,", "4)", "33.0", "5.5"]
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("jax/made")),
                                  np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5)
