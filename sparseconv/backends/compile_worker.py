"""A background compile worker (see :class:`sparseconv.backends.compiling.Background`).

Reads jobs from stdin, each a length-prefixed pickle of ``(hook, args)``, runs ``hook(*args)``
(a backend's ``precompile`` hook on a map's shape: the kernels land in the compilers' disk
caches) and answers each with a length-prefixed pickle of (None or the error's first line, the
seconds it took). What
the compilers print goes to /dev/null: the answers keep the original stdout to themselves.
It ends when stdin closes: when the process that started it ends, or lets an idle worker go.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # compilers and ptxas write to fd 1 and 2: not into the answers
    os.dup2(null, 2)
    jobs = sys.stdin.buffer
    while True:
        size = jobs.read(8)
        if len(size) < 8:
            return
        payload = jobs.read(struct.unpack("<Q", size)[0])
        start = time.perf_counter()
        try:
            hook, args = pickle.loads(payload)
            hook(*args)
            error = None
        except BaseException as failure:  # noqa: BLE001 - sent back, the worker goes on
            lines = str(failure).strip().splitlines()
            error = f"{type(failure).__name__}: {lines[0] if lines else ''}"[:300]
        data = pickle.dumps((error, time.perf_counter() - start))
        answers.write(struct.pack("<Q", len(data)) + data)
        answers.flush()


if __name__ == "__main__":
    main()
