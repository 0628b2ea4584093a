# SPDX-License-Identifier: Apache-2.0
"""The two processes of tests/gpu/run.sh: `publish DIR` and `attach DIR` (real GPU only)."""
import os
import sys
import time

import torch

import dlpack_ipc

# name -> float32 elements: 4 KiB and 1 GiB, each as legacy IPC (torch) and as VMM
SIZES = {"4k": 1024, "1g": 1 << 28}
OFFSET = 256  # elements: the torch tensors sit inside a larger allocation


def expected(n):
    return torch.arange(n, dtype=torch.float32, device="cuda").remainder_(65521)


def publish(d):
    keep = []
    for tag, n in SIZES.items():
        base = torch.empty(n + 2 * OFFSET, dtype=torch.float32, device="cuda")
        x = base[OFFSET:OFFSET + n]
        x.copy_(expected(n))
        keep.append(base)
        dlpack_ipc.publish(f"gpu/torch_{tag}", x)
        v = dlpack_ipc.empty((n,), "float32", device="cuda:0")
        torch.from_dlpack(v).copy_(expected(n))
        torch.cuda.synchronize()
        dlpack_ipc.publish(f"gpu/vmm_{tag}", v)
    open(os.path.join(d, "published"), "w").close()
    while not os.path.exists(os.path.join(d, "attached")):
        time.sleep(0.05)
    for tag in SIZES:
        dlpack_ipc.unpublish(f"gpu/torch_{tag}")
        dlpack_ipc.unpublish(f"gpu/vmm_{tag}")


def attach(d):
    import cupy

    for kind in ("torch", "vmm"):
        for tag, n in SIZES.items():
            name = f"gpu/{kind}_{tag}"
            want = expected(n)
            t0 = time.perf_counter()
            t = dlpack_ipc.attach(name)
            x = torch.from_dlpack(t)
            t1 = time.perf_counter()
            assert t.device == "cuda:0" and x.is_cuda, (t.device, x.device)
            assert torch.equal(x, want), f"{name}: torch.from_dlpack content differs"
            c = cupy.from_dlpack(dlpack_ipc.attach(name))
            assert bool((c == cupy.from_dlpack(want)).all()), f"{name}: cupy content differs"
            print(f"{name}: {n * 4} bytes, attach + torch.from_dlpack "
                  f"{(t1 - t0) * 1e6:.0f} us")
            del x, c, t
            torch.cuda.synchronize()


if __name__ == "__main__":
    {"publish": publish, "attach": attach}[sys.argv[1]](sys.argv[2])
