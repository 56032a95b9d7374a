"""What a sweep does with a candidate that fails: one line for the user, a quiet compiler, a
time limit, and a clear stop when a candidate has broken the CUDA context.

A candidate that raises (a compile error, an unsupported shape, out of memory) or is far too
slow is skipped and the sweep goes on. Compilers write to the process's stdout and stderr
(Triton prints a whole PTX "reproducer" before raising ``PTXASError``; MLIR diagnostics and
ptxas/nvcc children write to the file descriptors), so a candidate's first call, where it
compiles, runs with both descriptors captured; the text goes to the DEBUG log. After an illegal
address every later CUDA call in the process fails; :func:`probe` notices that right after the
candidate that did it, so the user gets :class:`CudaContextPoisoned` naming it instead of an
error at some later, unrelated call.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
import tempfile
from collections.abc import Iterator

import torch

from .. import config
from ..backends.problem import PIN_ARGUMENT

SLOW_FACTOR = 20.0
SLOW_FLOOR_MS = 100.0
"""A candidate whose first two timed calls each cost more than SLOW_FACTOR times the
reference's call plus SLOW_FLOOR_MS is stopped there: it cannot win (the fallback would run
instead), and its remaining warm-ups and samples could take many seconds on a large layer. The
floor keeps a tiny problem's launch overheads and a busy machine from disqualifying anything
(a 1 ms CPU call took 60-80 ms with other test suites running on 2 cores); below it, timing a
hopeless candidate in full costs under a second anyway."""


class CudaContextPoisoned(RuntimeError):
    """A candidate left the CUDA context unusable: every later CUDA call in this process fails."""


def time_limit_ms(reference_ms: float) -> float:
    """The most a candidate's warm call may cost, given the reference's call took ``reference_ms``."""
    return SLOW_FACTOR * reference_ms + SLOW_FLOOR_MS


def first_line(error: BaseException) -> str:
    """``Type: first non-blank line`` of ``error``'s message (at most 300 characters)."""
    line = message_line(error)
    return f"{type(error).__name__}: {line}"[:300] if line else type(error).__name__


def message_line(error: BaseException) -> str:
    """The first non-blank line of ``error``'s message ("" if none).

    Triton's CompilationError starts with the source location and keeps the cause in
    ``error_message``, which is the more useful line."""
    text = getattr(error, "error_message", None)
    if not isinstance(text, str) or not text.strip():
        text = str(error)
    return next((part.strip() for part in text.splitlines() if part.strip()), "")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (torch's OutOfMemoryError, or a RuntimeError or
    another library's error that says so)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def probe(device: torch.device) -> Exception | None:
    """None if a tiny op still runs on ``device`` (always on the CPU), else the error it raised."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        (torch.ones(1, device=device) + 1).item()
    except Exception as error:  # noqa: BLE001 - any failure here means the context is unusable
        return error
    return None


def poisoned(
    namespace: str, candidate_id: str, error: BaseException, probe_error: BaseException, recorded: bool
) -> CudaContextPoisoned:
    """The error to raise when ``candidate_id`` raised ``error`` and the probe then failed with
    ``probe_error``; ``recorded``: the sweep stored the candidate as failed in the cache."""
    argument = PIN_ARGUMENT.get(namespace, "the layer's *_algo argument")
    variable = config.ALGO_MODE_VARIABLES.get(namespace, "SPARSECONV_*_ALGO_MODE")
    backend = candidate_id.split("[", 1)[0]
    skipped = ("It is recorded as failed in the tuning cache, so the next run skips it for this layer shape. "
               if recorded else "")
    return CudaContextPoisoned(
        f"sparseconv: candidate {candidate_id} for {namespace} raised {first_line(error)!r}, and since then "
        f"every CUDA call fails ({first_line(probe_error)}): this process's CUDA context is broken for good. "
        f"Restart the process. {skipped}To keep {backend} out, pin another algorithm: "
        f"{argument}='explicit_gemm' (or a list of names without {backend}), or set {variable}=explicit_gemm."
    )


class Captured:
    """What was written to stdout and stderr inside :func:`captured_output`; ``text`` is set on exit."""

    text = ""


@contextlib.contextmanager
def captured_output() -> Iterator[Captured]:
    """Send what Python code, C code and child processes write to stdout and stderr into the
    yielded :class:`Captured` instead of the terminal.

    The file descriptors are the process's, so another thread's output in the meantime is
    captured too: wrap only short, rare calls (a candidate's first, compiling call)."""
    captured = Captured()
    sink = io.StringIO()
    _flush_streams()
    with tempfile.TemporaryFile() as spill:
        saved: list[tuple[int, int]] = []
        try:
            for fd in (1, 2):
                with contextlib.suppress(OSError):  # a closed descriptor (a daemon) has nothing to hide
                    saved.append((fd, os.dup(fd)))
                    os.dup2(spill.fileno(), fd)
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield captured
        finally:
            _flush_streams()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            spill.seek(0)
            captured.text = sink.getvalue() + spill.read().decode(errors="replace")


def _flush_streams() -> None:
    # Python's and C's buffers: what was written before the swap must not land in the capture,
    # and what was written inside it must not reach the terminal after it.
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
