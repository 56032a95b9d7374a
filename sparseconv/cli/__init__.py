"""Front ends: the demo and the command-line tools (``python -m sparseconv demo | cache | tune | cutlass``),
and what the benchmark scripts in ``scripts/`` share (:mod:`.bench`)."""
