"""Measuring policies on live traffic: the server's admin view, request spans -> per-policy windows,
the objective over a window, and paired / interleaved comparisons against a control."""
