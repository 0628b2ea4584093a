# SPDX-License-Identifier: Apache-2.0
"""A local Ray for a benchmark's peer rows, started the one way bench_py.py and bench_model.py
share: no usage report, no token written under ~/.ray, no dashboard, its files in a private
temporary directory that the caller removes (ray_temp_dir(), then shutil.rmtree once
ray.shutdown() returned)."""
import os
import tempfile


def ray_temp_dir():
    """A new private directory for one Ray's sockets, logs and spilled objects."""
    return tempfile.mkdtemp(prefix="bench-ray-")


def ray_init(ray, temp_dir, **kwargs):
    """ray.init() of a local Ray in temp_dir; kwargs (num_cpus, object_store_memory...) go to
    ray.init as they are."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", False)
    return ray.init(_temp_dir=temp_dir, **kwargs)
