"""A precompile hook a background compile worker can import (tests/tune is on its path): it
waits for the file named by $SC_TEST_RELEASE (if set) and appends its pid to the file
named by $SC_TEST_COMPILED, so a test sees which process compiled, and when."""

from __future__ import annotations

import os
import time

LOG = "SC_TEST_COMPILED"
RELEASE = "SC_TEST_RELEASE"


def precompile(namespace, problem, params, kernel_map) -> None:
    release = os.environ.get(RELEASE)
    deadline = time.monotonic() + 60
    while release and not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} never appeared")
        time.sleep(0.01)
    with open(os.environ[LOG], "a", encoding="utf-8") as log:
        log.write(f"{os.getpid()}\n")
