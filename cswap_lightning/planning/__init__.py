"""Deciding what to move and how: the profiler, the codec time model, the cost-model advisor,
the host arena's layout and the kernel tuner."""
