"""What drives the tuner from outside: the load generator, the `moespec demo` run and its report,
the benchmark rig (a server child process and a background CPU load), and progress lines."""
