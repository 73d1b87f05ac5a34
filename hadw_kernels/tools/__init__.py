"""Tools around the library, loaded only when used: the memory planner, the code
generator, the demo and their command-line helpers."""
