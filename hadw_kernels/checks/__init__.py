"""A call's checks: the argument primitives, the checks of values read in one host
synchronisation, and the validation that returns the call's batch."""
