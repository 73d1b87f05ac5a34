"""A call's data: the token layout every backend computes on, the linear loss's active
rows, and the call's inputs and validated batch."""
