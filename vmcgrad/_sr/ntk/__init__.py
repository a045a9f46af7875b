"""The NTK wing: the sample-space kernel, MinSR's update and its routes."""
