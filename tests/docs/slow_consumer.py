# SPDX-License-Identifier: Apache-2.0
"""Two producers and one slow consumer on a channel, written as a newcomer would write it.

Two spawned producers send PER_PRODUCER messages each and close their side (leaving the `with`
block); the parent receives with `for msg in ch`, slower than they send, so the queue fills and
the producers wait for room. Every message must arrive, each producer's in the order it sent
them, and the loop must end by itself once both producers closed and the queue is drained (a
watchdog fails the script if it does not within LOOP_END_TIMEOUT_S). The channel is opened for
two producers, so the one that finishes first cannot end the stream before the other started.

Run by tests/newcomer.sh with the venv's interpreter, against the daemon the user started.
"""
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np

import dlpack_ipc

PRODUCERS = 2
PER_PRODUCER = 50
# the consumer's work per message: slower than the producers, so that they wait for room
CONSUMER_DELAY_S = 0.01
# how long the whole exchange may take before the watchdog calls it a hang
LOOP_END_TIMEOUT_S = 60


def produce(name, k):
    with dlpack_ipc.channel(name, producers=PRODUCERS) as ch:
        for i in range(PER_PRODUCER):
            ch.send(np.array([k, i], dtype=np.int64))


def watchdog(done):
    if not done.wait(LOOP_END_TIMEOUT_S):
        print(f"slow_consumer: the consumer's loop did not end within {LOOP_END_TIMEOUT_S} s "
              "after the producers closed", file=sys.stderr, flush=True)
        os._exit(1)


def main():
    name = f"newcomer/slow-consumer-{os.getpid()}"  # the parent's: children are passed it
    ch = dlpack_ipc.channel(name, producers=PRODUCERS)
    done = threading.Event()
    threading.Thread(target=watchdog, args=(done,), daemon=True).start()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=produce, args=(name, k)) for k in range(PRODUCERS)]
    for p in procs:
        p.start()
    got = []
    try:
        for msg in ch:
            got.append(tuple(int(v) for v in np.from_dlpack(msg)))
            del msg
            time.sleep(CONSUMER_DELAY_S)
        done.set()
        for p in procs:
            p.join()
    finally:
        ch.remove()
    ok = True
    if [p.exitcode for p in procs] != [0] * PRODUCERS:
        print(f"slow_consumer: producers exited with {[p.exitcode for p in procs]}")
        ok = False
    for k in range(PRODUCERS):
        seq = [i for kk, i in got if kk == k]
        if seq != list(range(PER_PRODUCER)):
            print(f"slow_consumer: producer {k}'s messages arrived as {seq}")
            ok = False
    print(f"slow_consumer: {len(got)} of {PRODUCERS * PER_PRODUCER} messages, "
          "then the loop ended by itself")
    return 0 if ok and len(got) == PRODUCERS * PER_PRODUCER else 1


if __name__ == "__main__":
    sys.exit(main())
