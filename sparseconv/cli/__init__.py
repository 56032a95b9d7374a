"""Front ends: the demo and the command-line tools (``python -m sparseconv demo | cache | tune | cutlass``)."""
