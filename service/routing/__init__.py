"""Views over routed experts: per-window expert sets and the expert-parallel placement view."""
